//! A connection between two members: mutual TLS proves both ends, then
//! one exchange (inside TLS) settles whether the rest of the connection
//! stays encrypted or continues on the bare TCP stream the handshake just
//! authenticated (the cheap mode of the data path, like Ceph msgr2's
//! "crc" mode: strangers cannot open or use a connection; someone on the
//! path who can inject TCP segments is outside what it defends).
//!
//! The exchange, each side's two bytes, after the handshake:
//! client `[HELLO_VERSION, wants_encryption]`, server
//! `[HELLO_VERSION, encrypted]` where `encrypted` is true when either side
//! wants it. Neither side sends anything else before the answer, and the
//! server sends no session tickets, so no TLS record is left in flight
//! when the stream drops to plain TCP (checked: any buffered byte there is
//! a protocol error).

use crate::{hex, TlsError};
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ServerConfig};
use sha2::{Digest, Sha256};
use shoal_model::NodeId;
use std::io::Read;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a connection may take from TCP accept (or connect) to a
/// proven member, in milliseconds: a TLS 1.3 handshake is two round trips
/// and a few signatures; a connection that says nothing is closed.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 5_000;

/// How often an open connection checks that its member is still
/// admitted, in milliseconds: a revoked node loses the connections it
/// holds within this.
pub const READMIT_CHECK_MS: u64 = 1_000;

/// Resolves once `member` is no longer admitted (checked every
/// [`READMIT_CHECK_MS`]): serve a connection until this, then drop it.
pub async fn until_revoked(admit: &Admit, member: &Member) {
    let mut t = tokio::time::interval(Duration::from_millis(READMIT_CHECK_MS));
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        t.tick().await;
        if !admit(member) {
            tracing::warn!(
                node = member.node,
                "closing a connection: its certificate is revoked"
            );
            return;
        }
    }
}

/// Version of the two-byte exchange after the handshake.
const HELLO_VERSION: u8 = 1;

/// A member, as its certificate proves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub node: NodeId,
    /// SHA-256 of its certificate (DER), hex: what revocation names.
    pub cert_sha256: String,
}

/// SHA-256 of a certificate (DER), hex.
pub fn fingerprint(cert: &CertificateDer<'_>) -> String {
    hex(&Sha256::digest(cert.as_ref()))
}

/// The member a certificate names (common name `node-<id>`). Does not
/// check the signature: call it on a certificate a verifier accepted.
pub fn member_of(cert: &CertificateDer<'_>) -> Result<Member, TlsError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| TlsError::Cert(format!("unreadable certificate: {e}")))?;
    let cn = parsed
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or_else(|| TlsError::NotMember("certificate without a common name".into()))?;
    let node = cn
        .strip_prefix("node-")
        .and_then(|n| n.parse::<NodeId>().ok())
        .ok_or_else(|| TlsError::NotMember(format!("{cn:?} is not a node")))?;
    Ok(Member {
        node,
        cert_sha256: fingerprint(cert),
    })
}

/// Whether a proven member may still talk to this node (its certificate
/// is not revoked). Called once per connection.
pub type Admit = Arc<dyn Fn(&Member) -> bool + Send + Sync>;

/// Any byte stream a member connection can run on.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// A proven member connection.
pub enum MemberStream {
    /// Authenticated, not encrypted: the bare stream.
    Plain(TcpStream),
    /// Authenticated and encrypted.
    Tls(Box<dyn Io>),
}

/// How this node proves itself to members and checks them.
#[derive(Clone)]
pub struct PeerSecurity {
    pub server: Arc<ServerConfig>,
    pub client: Arc<ClientConfig>,
    /// Whether this node asks for its connections to stay encrypted.
    pub encrypt: bool,
    pub admit: Admit,
}

fn handshake_err(e: std::io::Error) -> TlsError {
    TlsError::Handshake(e.to_string())
}

/// The member behind the first certificate of `certs` (a chain a verifier
/// accepted), if admitted.
pub fn admitted(certs: Option<&[CertificateDer<'_>]>, admit: &Admit) -> Result<Member, TlsError> {
    let cert = certs
        .and_then(|c| c.first())
        .ok_or_else(|| TlsError::NotMember("no certificate shown".into()))?;
    let m = member_of(cert)?;
    if !admit(&m) {
        return Err(TlsError::NotMember(format!(
            "the certificate of node {} is revoked",
            m.node
        )));
    }
    Ok(m)
}

/// Fails when rustls holds bytes that arrived after the exchange: they
/// would be lost by dropping to plain TCP.
fn nothing_buffered(reader: &mut rustls::Reader<'_>) -> Result<(), TlsError> {
    let mut b = [0u8; 1];
    match reader.read(&mut b) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
        _ => Err(TlsError::Handshake(
            "data after the hello exchange before switching to plain".into(),
        )),
    }
}

/// Reads the other end's two bytes of the exchange (`what` names them in
/// errors) and checks their version.
async fn read_hello<S: AsyncRead + Unpin>(s: &mut S, what: &str) -> Result<[u8; 2], TlsError> {
    let mut b = [0u8; 2];
    s.read_exact(&mut b).await.map_err(handshake_err)?;
    if b[0] != HELLO_VERSION {
        return Err(TlsError::Handshake(format!(
            "{what} version {} (this node speaks {HELLO_VERSION})",
            b[0]
        )));
    }
    Ok(b)
}

impl PeerSecurity {
    /// Proves the member that connected on `tcp`, within
    /// [`HANDSHAKE_TIMEOUT_MS`].
    pub async fn accept(&self, tcp: TcpStream) -> Result<(MemberStream, Member), TlsError> {
        let t = Duration::from_millis(HANDSHAKE_TIMEOUT_MS);
        tokio::time::timeout(t, self.accept_inner(tcp))
            .await
            .map_err(|_| TlsError::Timeout)?
    }

    async fn accept_inner(&self, tcp: TcpStream) -> Result<(MemberStream, Member), TlsError> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.server.clone());
        let mut tls = acceptor.accept(tcp).await.map_err(handshake_err)?;
        let member = admitted(tls.get_ref().1.peer_certificates(), &self.admit)?;
        let hello = read_hello(&mut tls, "hello").await?;
        let encrypted = self.encrypt || hello[1] != 0;
        tls.write_all(&[HELLO_VERSION, encrypted as u8])
            .await
            .map_err(handshake_err)?;
        tls.flush().await.map_err(handshake_err)?;
        if encrypted {
            return Ok((MemberStream::Tls(Box::new(tls)), member));
        }
        let (tcp, mut conn) = tls.into_inner();
        nothing_buffered(&mut conn.reader())?;
        Ok((MemberStream::Plain(tcp), member))
    }

    /// Opens a member connection over `tcp` and proves the server, within
    /// [`HANDSHAKE_TIMEOUT_MS`].
    pub async fn connect(&self, tcp: TcpStream) -> Result<(MemberStream, Member), TlsError> {
        let t = Duration::from_millis(HANDSHAKE_TIMEOUT_MS);
        tokio::time::timeout(t, self.connect_inner(tcp))
            .await
            .map_err(|_| TlsError::Timeout)?
    }

    async fn connect_inner(&self, tcp: TcpStream) -> Result<(MemberStream, Member), TlsError> {
        let connector = tokio_rustls::TlsConnector::from(self.client.clone());
        let name = ServerName::try_from(crate::MEMBER_NAME)
            .map_err(|e| TlsError::Handshake(e.to_string()))?;
        let mut tls = connector.connect(name, tcp).await.map_err(handshake_err)?;
        let member = admitted(tls.get_ref().1.peer_certificates(), &self.admit)?;
        tls.write_all(&[HELLO_VERSION, self.encrypt as u8])
            .await
            .map_err(handshake_err)?;
        tls.flush().await.map_err(handshake_err)?;
        let answer = read_hello(&mut tls, "answer").await?;
        if answer[1] != 0 {
            return Ok((MemberStream::Tls(Box::new(tls)), member));
        }
        let (tcp, mut conn) = tls.into_inner();
        nothing_buffered(&mut conn.reader())?;
        Ok((MemberStream::Plain(tcp), member))
    }
}
