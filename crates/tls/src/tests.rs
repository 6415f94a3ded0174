//! Certificates made and checked, and member handshakes over real sockets.

use super::*;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn node(ca: &CaMaterial, id: u64) -> NodeCredentials {
    let req = KeyRequest::new().unwrap();
    let subject = Subject::Node {
        id,
        addrs: vec![IpAddr::V4(Ipv4Addr::new(127, 0, 0, id as u8))],
    };
    let cert = issue(ca, "c1", &req.csr_pem, &subject).unwrap();
    NodeCredentials::from_pem(&ca.cert_pem, &cert, &req.key_pem).unwrap()
}

fn security(c: &NodeCredentials, encrypt: bool, admit: Admit) -> PeerSecurity {
    PeerSecurity {
        server: c.server_config(ClientAuth::Required).unwrap(),
        client: c.client_config().unwrap(),
        encrypt,
        admit,
    }
}

fn everyone() -> Admit {
    Arc::new(|_: &Member| true)
}

/// Accepts one connection with `server`, connects with `client`; answers
/// both ends' results.
async fn pair(
    server: PeerSecurity,
    client: PeerSecurity,
) -> (
    Result<(MemberStream, Member), TlsError>,
    Result<(MemberStream, Member), TlsError>,
) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let s = tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        server.accept(tcp).await
    });
    let tcp = TcpStream::connect(addr).await.unwrap();
    let c = client.connect(tcp).await;
    (s.await.unwrap(), c)
}

async fn echo_through(a: MemberStream, b: MemberStream) {
    async fn roundtrip<A, B>(mut a: A, mut b: B)
    where
        A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        a.write_all(b"frame-1").await.unwrap();
        a.flush().await.unwrap();
        let mut got = [0u8; 7];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"frame-1");
    }
    match (a, b) {
        (MemberStream::Plain(a), MemberStream::Plain(b)) => roundtrip(a, b).await,
        (MemberStream::Tls(a), MemberStream::Tls(b)) => roundtrip(a, b).await,
        _ => panic!("the two ends disagree on encryption"),
    }
}

#[tokio::test]
async fn members_prove_each_other_and_drop_to_plain_tcp_when_asked() {
    let ca = new_ca("c1").unwrap();
    let (n1, n2) = (node(&ca, 1), node(&ca, 2));
    assert_eq!((n1.node, n2.node), (1, 2));
    let (s, c) = pair(
        security(&n1, false, everyone()),
        security(&n2, false, everyone()),
    )
    .await;
    let ((ss, sm), (cs, cm)) = (s.unwrap(), c.unwrap());
    assert_eq!((sm.node, cm.node), (2, 1), "each end knows the other");
    assert!(matches!(ss, MemberStream::Plain(_)));
    echo_through(cs, ss).await;
}

#[tokio::test]
async fn either_side_asking_for_encryption_keeps_tls() {
    let ca = new_ca("c1").unwrap();
    let (n1, n2) = (node(&ca, 1), node(&ca, 2));
    for (se, ce) in [(true, false), (false, true), (true, true)] {
        let (s, c) = pair(security(&n1, se, everyone()), security(&n2, ce, everyone())).await;
        let (ss, cs) = (s.unwrap().0, c.unwrap().0);
        assert!(matches!(ss, MemberStream::Tls(_)), "{se} {ce}");
        echo_through(ss, cs).await;
    }
}

#[tokio::test]
async fn another_clusters_node_a_client_certificate_and_a_revoked_node_are_refused() {
    let ca = new_ca("c1").unwrap();
    let other = new_ca("c2").unwrap();
    let n1 = node(&ca, 1);
    // A node of another cluster, either end.
    let stranger = node(&other, 2);
    let (s, c) = pair(
        security(&n1, false, everyone()),
        security(&stranger, false, everyone()),
    )
    .await;
    assert!(s.is_err() && c.is_err());
    let (s, c) = pair(
        security(&stranger, false, everyone()),
        security(&n1, false, everyone()),
    )
    .await;
    assert!(s.is_err() && c.is_err());
    // A client certificate of the right cluster is not a node.
    let req = KeyRequest::new().unwrap();
    let client = issue(
        &ca,
        "c1",
        &req.csr_pem,
        &Subject::Client {
            name: "qemu".into(),
        },
    )
    .unwrap();
    assert!(matches!(
        NodeCredentials::from_pem(&ca.cert_pem, &client, &req.key_pem),
        Err(TlsError::NotMember(_))
    ));
    // A revoked node.
    let n2 = node(&ca, 2);
    let not_2: Admit = Arc::new(|m: &Member| m.node != 2);
    let (s, _c) = pair(
        security(&n1, false, not_2),
        security(&n2, false, everyone()),
    )
    .await;
    assert!(matches!(s, Err(TlsError::NotMember(_))));
}

#[tokio::test]
async fn plain_tcp_and_silence_are_refused() {
    let ca = new_ca("c1").unwrap();
    let n1 = node(&ca, 1);
    let sec = security(&n1, false, everyone());
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let s = tokio::spawn(async move {
        let mut out = Vec::new();
        for _ in 0..2 {
            let (tcp, _) = l.accept().await.unwrap();
            out.push(sec.accept(tcp).await.map(|_| ()));
        }
        out
    });
    // A frame in the clear, as before mutual TLS.
    let mut t = TcpStream::connect(addr).await.unwrap();
    t.write_all(&[0x53, 0x48, 0x4f, 0x4c, 1, 0, 0, 0])
        .await
        .unwrap();
    let mut rest = Vec::new();
    let _ = t.read_to_end(&mut rest).await;
    // A connection that says nothing.
    let silent = TcpStream::connect(addr).await.unwrap();
    let out = s.await.unwrap();
    drop(silent);
    assert!(
        matches!(out[0], Err(TlsError::Handshake(_))),
        "{:?}",
        out[0]
    );
    assert!(matches!(out[1], Err(TlsError::Timeout)), "{:?}", out[1]);
}

#[tokio::test]
async fn a_joining_node_reaches_only_the_cluster_its_pin_names() {
    let ca = new_ca("c1").unwrap();
    let n1 = node(&ca, 1);
    let server = n1.server_config(ClientAuth::Optional).unwrap();
    for (pin, ok) in [
        (JoinPin::of_pem(&ca.cert_pem).unwrap(), true),
        (
            JoinPin::of_pem(&new_ca("c2").unwrap().cert_pem).unwrap(),
            false,
        ),
    ] {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(server.clone());
        let s = tokio::spawn(async move {
            let (tcp, _) = l.accept().await.unwrap();
            acceptor
                .accept(tcp)
                .await
                .map(|t| t.get_ref().1.peer_certificates().is_none())
        });
        let (config, mismatch) = join_client_config(&pin).unwrap();
        let connector = tokio_rustls::TlsConnector::from(config);
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let c = connector.connect(name, tcp).await;
        assert_eq!(c.is_ok(), ok);
        assert_eq!(mismatch.load(std::sync::atomic::Ordering::SeqCst), !ok);
        if ok {
            assert!(s.await.unwrap().unwrap(), "the joiner shows no certificate");
        }
    }
}

#[test]
fn credentials_survive_a_save_and_a_load_with_private_modes() {
    use std::os::unix::fs::PermissionsExt;
    let ca = new_ca("c1").unwrap();
    let req = KeyRequest::new().unwrap();
    let subject = Subject::Node {
        id: 7,
        addrs: vec![],
    };
    let cert = issue(&ca, "c1", &req.csr_pem, &subject).unwrap();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("tls");
    assert!(NodeCredentials::load(&dir).unwrap().is_none());
    NodeCredentials::save(&dir, &ca.cert_pem, &cert, &req.key_pem).unwrap();
    let back = NodeCredentials::load(&dir).unwrap().unwrap();
    assert_eq!(back.node, 7);
    assert_eq!(back.pin(), JoinPin::of_pem(&ca.cert_pem).unwrap());
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join(KEY_FILE)), 0o600);
    // A certificate of another CA does not load as this cluster's.
    let other = new_ca("c2").unwrap();
    let foreign = issue(&other, "c2", &req.csr_pem, &subject).unwrap();
    assert!(NodeCredentials::from_pem(&ca.cert_pem, &foreign, &req.key_pem).is_err());
    // A request whose signature does not hold is refused.
    let bad = req.csr_pem.replace('A', "B");
    assert!(issue(&ca, "c1", &bad, &subject).is_err());
}
