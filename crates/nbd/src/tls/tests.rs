//! STARTTLS against the real server on 127.0.0.1: the three modes, and
//! which client certificates pass, with a small client over rustls.

use super::*;
use crate::mem::MemExports;
use crate::serve;
use crate::server::HANDSHAKE_TIMEOUT_S;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use shoal_tls::{issue, new_ca, CaMaterial, ClientAuth, KeyRequest, NodeCredentials, Subject};
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;

/// Bound on a whole test: each takes milliseconds (the timeout test's
/// virtual seconds excepted), a hang must fail, not stall the suite.
const TEST_TIMEOUT_S: u64 = 30;
const DISK: &str = "d";
/// Size of the test export, bytes: small, it is held in memory.
const DISK_SIZE: usize = 1 << 20;
/// Bytes written and read back through the transmission phase.
const BLOCK: usize = 4096;

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(TEST_TIMEOUT_S), f)
        .await
        .expect("test timed out")
}

/// A cluster CA and the server configuration of a node it certified
/// (for 127.0.0.1), which requires a client certificate of that CA.
struct Pki {
    ca: CaMaterial,
    server: Arc<ServerConfig>,
}

fn pki(cluster: &str) -> Pki {
    let ca = new_ca(cluster).unwrap();
    let req = KeyRequest::new().unwrap();
    let subject = Subject::Node {
        id: 1,
        addrs: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
    };
    let cert = issue(&ca, cluster, &req.csr_pem, &subject).unwrap();
    let creds = NodeCredentials::from_pem(&ca.cert_pem, &cert, &req.key_pem).unwrap();
    let server = creds.server_config(ClientAuth::Required).unwrap();
    Pki { ca, server }
}

/// A TLS client that trusts `trusted` (the server's CA) and shows a
/// client certificate issued by `issuer`, or none.
fn client(trusted: &Pki, issuer: Option<&Pki>) -> Arc<ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(trusted.ca.cert_pem.as_bytes()).unwrap())
        .unwrap();
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let Some(issuer) = issuer else {
        return Arc::new(builder.with_no_client_auth());
    };
    let req = KeyRequest::new().unwrap();
    let subject = Subject::Client {
        name: "test".to_string(),
    };
    let cert = issue(&issuer.ca, "c", &req.csr_pem, &subject).unwrap();
    let cert = CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
    let key = PrivateKeyDer::from_pem_slice(req.key_pem.as_bytes()).unwrap();
    Arc::new(builder.with_client_auth_cert(vec![cert], key).unwrap())
}

/// `serve` with one export, on a free port of 127.0.0.1.
async fn listen(tls: NbdTls) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let mut e = MemExports::new();
    e.add(DISK, DISK_SIZE);
    tokio::spawn(serve(l, Arc::new(e), std::future::pending(), tls));
    addr
}

/// Connects, reads the greeting and answers it with `client_flags`.
async fn connect_with(addr: SocketAddr, client_flags: u32) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g).await.unwrap();
    decode_greeting(&g).unwrap();
    s.write_all(&client_flags.to_be_bytes()).await.unwrap();
    s
}

async fn connect(addr: SocketAddr) -> TcpStream {
    connect_with(addr, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await
}

async fn send_option<S: AsyncWrite + Unpin>(s: &mut S, option: u32, data: &[u8]) -> io::Result<()> {
    let o = OptionRequest {
        option,
        data: bytes::Bytes::copy_from_slice(data),
    };
    s.write_all(&o.encode()).await?;
    s.flush().await
}

async fn read_reply<S: AsyncRead + Unpin>(s: &mut S) -> io::Result<OptionReply> {
    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h).await?;
    let h = OptionReplyHeader::decode(&h).unwrap();
    assert!(h.len < 1 << 20, "absurd option reply length");
    let mut data = vec![0u8; h.len as usize];
    s.read_exact(&mut data).await?;
    Ok(OptionReply::new(h.option, h.reply_type, data))
}

/// Sends `option`; answers its replies, the final one (ACK or error) last.
async fn ask<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    option: u32,
    data: &[u8],
) -> io::Result<Vec<OptionReply>> {
    send_option(s, option, data).await?;
    let mut replies = Vec::new();
    loop {
        let r = read_reply(s).await?;
        assert_eq!(r.option, option);
        let last = r.reply_type == NBD_REP_ACK || r.is_error();
        replies.push(r);
        if last {
            return Ok(replies);
        }
    }
}

fn go_data(name: &str) -> Vec<u8> {
    InfoRequest {
        name: name.to_string(),
        requests: vec![],
    }
    .encode()
}

/// The type of the final reply to `option`.
async fn final_reply<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    option: u32,
    data: &[u8],
) -> u32 {
    let replies = ask(s, option, data).await.unwrap();
    replies.last().map(|r| r.reply_type).unwrap_or_default()
}

/// NBD_OPT_STARTTLS (answered NBD_REP_ACK), then the TLS handshake.
async fn upgrade(
    mut s: TcpStream,
    config: Arc<ClientConfig>,
) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    assert_eq!(
        final_reply(&mut s, NBD_OPT_STARTTLS, &[]).await,
        NBD_REP_ACK
    );
    let name = ServerName::try_from("127.0.0.1").unwrap();
    TlsConnector::from(config).connect(name, s).await
}

/// Upgrades with `config` and sends NBD_OPT_GO: its replies, or the
/// error that ended the connection.
async fn tls_go(addr: SocketAddr, config: Arc<ClientConfig>) -> io::Result<Vec<OptionReply>> {
    let mut t = upgrade(connect(addr).await, config).await?;
    ask(&mut t, NBD_OPT_GO, &go_data(DISK)).await
}

async fn request<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    command: Command,
    handle: u64,
    payload: &[u8],
) -> SimpleReply {
    let req = Request {
        flags: 0,
        command,
        handle,
        offset: 0,
        len: BLOCK as u32,
    };
    let mut buf = req.encode().to_vec();
    buf.extend_from_slice(payload);
    s.write_all(&buf).await.unwrap();
    s.flush().await.unwrap();
    let mut h = [0u8; SIMPLE_REPLY_LEN];
    s.read_exact(&mut h).await.unwrap();
    SimpleReply::decode(&h).unwrap()
}

/// After GO: writes a block, reads it back, disconnects.
async fn write_read_disconnect<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) {
    let data = [0x5au8; BLOCK];
    let r = request(s, Command::Write, 1, &data).await;
    assert_eq!((r.handle, r.error), (1, NBD_OK));
    let r = request(s, Command::Read, 2, &[]).await;
    assert_eq!((r.handle, r.error), (2, NBD_OK));
    let mut back = vec![0u8; BLOCK];
    s.read_exact(&mut back).await.unwrap();
    assert_eq!(back, data);
    let disc = Request {
        flags: 0,
        command: Command::Disc,
        handle: 3,
        offset: 0,
        len: 0,
    };
    s.write_all(&disc.encode()).await.unwrap();
    s.flush().await.unwrap();
    expect_closed(s).await;
}

/// The server closed the connection: nothing more to read.
async fn expect_closed<S: AsyncRead + Unpin>(s: &mut S) {
    let mut b = [0u8; 1];
    let r = s.read(&mut b).await;
    assert!(
        !matches!(r, Ok(n) if n > 0),
        "expected the connection closed"
    );
}

/// The server ended the TLS session with the alert `alert`.
fn assert_refused(r: io::Result<Vec<OptionReply>>, alert: &str) {
    match r {
        Err(e) => assert!(format!("{e:?}").contains(alert), "{e:?}, not {alert}"),
        Ok(replies) => panic!("served ({replies:?}), not refused with {alert}"),
    }
}

/// Before STARTTLS, FORCEDTLS answers every option but STARTTLS and
/// ABORT with NBD_REP_ERR_TLS_REQD (lists nothing, opens nothing), and
/// closes on NBD_OPT_EXPORT_NAME, which cannot be refused.
#[tokio::test]
async fn require_refuses_options_before_starttls() {
    within(async {
        assert_eq!(NBD_REP_ERR_TLS_REQD, (1 << 31) + 5);
        let addr = listen(NbdTls::Require(pki("c1").server.into())).await;
        let mut s = connect(addr).await;
        let go = go_data(DISK);
        for (option, data) in [
            (NBD_OPT_LIST, &[][..]),
            (NBD_OPT_INFO, &go[..]),
            (NBD_OPT_GO, &go[..]),
            (NBD_OPT_STRUCTURED_REPLY, &[][..]),
        ] {
            let replies = ask(&mut s, option, data).await.unwrap();
            let types: Vec<u32> = replies.iter().map(|r| r.reply_type).collect();
            assert_eq!(types, [NBD_REP_ERR_TLS_REQD], "option {option}");
        }
        send_option(&mut s, NBD_OPT_EXPORT_NAME, DISK.as_bytes())
            .await
            .unwrap();
        expect_closed(&mut s).await;

        let mut s = connect(addr).await;
        assert_eq!(final_reply(&mut s, NBD_OPT_ABORT, &[]).await, NBD_REP_ACK);
        expect_closed(&mut s).await;
    })
    .await
}

/// STARTTLS (not with data), then option haggling and transmission
/// inside TLS with a client certificate of the cluster; a second
/// STARTTLS is invalid.
#[tokio::test]
async fn require_serves_go_inside_tls() {
    within(async {
        let p = pki("c1");
        let addr = listen(NbdTls::Require(p.server.clone().into())).await;
        let mut s = connect(addr).await;
        assert_eq!(
            final_reply(&mut s, NBD_OPT_STARTTLS, b"x").await,
            NBD_REP_ERR_INVALID
        );
        let mut t = upgrade(s, client(&p, Some(&p))).await.unwrap();
        assert_eq!(
            final_reply(&mut t, NBD_OPT_STARTTLS, &[]).await,
            NBD_REP_ERR_INVALID
        );
        let listed = ask(&mut t, NBD_OPT_LIST, &[]).await.unwrap();
        let types: Vec<u32> = listed.iter().map(|r| r.reply_type).collect();
        assert_eq!(types, [NBD_REP_SERVER, NBD_REP_ACK]);
        let replies = ask(&mut t, NBD_OPT_GO, &go_data(DISK)).await.unwrap();
        assert_eq!(replies.last().map(|r| r.reply_type), Some(NBD_REP_ACK));
        let size = replies.iter().find_map(|r| match Info::decode(&r.data) {
            Ok(Info::Export { size, .. }) if r.reply_type == NBD_REP_INFO => Some(size),
            _ => None,
        });
        assert_eq!(size, Some(DISK_SIZE as u64));
        write_read_disconnect(&mut t).await;
    })
    .await
}

/// A TLS client without a client certificate, or with one of another
/// CA, does not get through the handshake; others are served still.
#[tokio::test]
async fn clients_without_a_certificate_of_the_ca_are_refused() {
    within(async {
        let (p, other) = (pki("c1"), pki("c2"));
        let addr = listen(NbdTls::Require(p.server.clone().into())).await;
        // TLS 1.3: the client hears of the refusal after its handshake.
        let refused = tls_go(addr, client(&p, None)).await;
        assert_refused(refused, "CertificateRequired");
        let refused = tls_go(addr, client(&p, Some(&other))).await;
        assert_refused(refused, "UnknownCA");
        let served = tls_go(addr, client(&p, Some(&p))).await.unwrap();
        assert_eq!(served.last().map(|r| r.reply_type), Some(NBD_REP_ACK));
    })
    .await
}

/// SELECTIVETLS: plain clients are served as without TLS, and a client
/// may upgrade.
#[tokio::test]
async fn allow_serves_plain_and_tls_clients() {
    within(async {
        let p = pki("c1");
        let addr = listen(NbdTls::Allow(p.server.clone().into())).await;
        let mut s = connect(addr).await;
        assert_eq!(
            final_reply(&mut s, NBD_OPT_GO, &go_data(DISK)).await,
            NBD_REP_ACK
        );
        write_read_disconnect(&mut s).await;

        let mut t = upgrade(connect(addr).await, client(&p, Some(&p)))
            .await
            .unwrap();
        assert_eq!(
            final_reply(&mut t, NBD_OPT_GO, &go_data(DISK)).await,
            NBD_REP_ACK
        );
        write_read_disconnect(&mut t).await;
    })
    .await
}

/// NOTLS: STARTTLS is not supported; the connection goes on plain.
#[tokio::test]
async fn off_answers_starttls_unsupported() {
    within(async {
        let addr = listen(NbdTls::Off).await;
        let mut s = connect(addr).await;
        assert_eq!(
            final_reply(&mut s, NBD_OPT_STARTTLS, &[]).await,
            NBD_REP_ERR_UNSUP
        );
        assert_eq!(
            final_reply(&mut s, NBD_OPT_GO, &go_data(DISK)).await,
            NBD_REP_ACK
        );
        write_read_disconnect(&mut s).await;
    })
    .await
}

/// TLS needs fixed newstyle: a client without it is closed at once when
/// TLS is required.
#[tokio::test]
async fn require_closes_a_client_without_fixed_newstyle() {
    within(async {
        let addr = listen(NbdTls::Require(pki("c1").server.into())).await;
        let mut s = connect_with(addr, NBD_FLAG_C_NO_ZEROES).await;
        expect_closed(&mut s).await;
    })
    .await
}

/// A client that stops after NBD_REP_ACK to STARTTLS (no TLS handshake)
/// is closed when the handshake time is up.
#[tokio::test(start_paused = true)]
async fn the_handshake_timeout_bounds_the_tls_handshake() {
    let addr = listen(NbdTls::Require(pki("c1").server.into())).await;
    within(async {
        let mut s = connect(addr).await;
        assert_eq!(
            final_reply(&mut s, NBD_OPT_STARTTLS, &[]).await,
            NBD_REP_ACK
        );
        let t0 = tokio::time::Instant::now();
        expect_closed(&mut s).await;
        assert!(t0.elapsed() >= Duration::from_secs(HANDSHAKE_TIMEOUT_S));
    })
    .await
}
