//! NBD over TLS (the spec's "TLS support": in-session upgrade with
//! NBD_OPT_STARTTLS, fixed newstyle only).
//!
//! * [`NbdTls`]: whether a listener offers TLS, and with which
//!   credentials ([`TlsCreds`]): x509 (a rustls configuration, which
//!   decides, among others, whether a client must show a certificate) or
//!   pre-shared keys ([`PskConfig`], OpenSSL).
//! * [`Phase`]: how option haggling treats TLS before and after the
//!   upgrade (the spec's NOTLS, SELECTIVETLS and FORCEDTLS modes).
//! * The TLS server handshake on an accepted connection, and [`Conn`] for
//!   the TLS stream so the transmission phase runs over it unchanged.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::ServerConfig;
use tokio::io::{AsyncRead, AsyncWrite, BufWriter, ReadBuf, ReadHalf, WriteHalf};
use tokio_openssl::SslStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::codec::*;
use crate::psk::PskConfig;
use crate::server::Conn;
use crate::NbdError;

/// Whether a listener offers TLS to its NBD clients.
#[derive(Debug, Clone, Default)]
pub enum NbdTls {
    /// No TLS (NOTLS): NBD_OPT_STARTTLS is answered NBD_REP_ERR_UNSUP.
    /// For a Unix socket, whose permissions say who may connect.
    #[default]
    Off,
    /// Plain clients are served as without TLS; a client may upgrade
    /// with NBD_OPT_STARTTLS (SELECTIVETLS, no export TLS-only).
    Allow(TlsCreds),
    /// Nothing but NBD_OPT_STARTTLS and NBD_OPT_ABORT is served before
    /// the upgrade (FORCEDTLS).
    Require(TlsCreds),
}

impl NbdTls {
    /// The TLS credentials, unless TLS is off.
    pub fn creds(&self) -> Option<&TlsCreds> {
        match self {
            NbdTls::Off => None,
            NbdTls::Allow(c) | NbdTls::Require(c) => Some(c),
        }
    }
}

/// What a listener's TLS proves its clients with: one kind per listener,
/// as nbdkit and qemu-nbd do.
#[derive(Debug, Clone)]
pub enum TlsCreds {
    /// Certificates (rustls): the configuration says which client
    /// certificates pass.
    X509(Arc<ServerConfig>),
    /// Pre-shared keys (TLS-PSK, OpenSSL): a client presents a known
    /// identity and proves it holds its key.
    Psk(PskConfig),
}

impl From<Arc<ServerConfig>> for TlsCreds {
    fn from(config: Arc<ServerConfig>) -> TlsCreds {
        TlsCreds::X509(config)
    }
}

impl From<PskConfig> for TlsCreds {
    fn from(config: PskConfig) -> TlsCreds {
        TlsCreds::Psk(config)
    }
}

/// How a stretch of option haggling treats TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// TLS is not offered on this connection.
    Unoffered,
    /// Before the upgrade, which the client may ask for; `required`:
    /// nothing else is served before it.
    Offered { required: bool },
    /// After the upgrade.
    Upgraded,
}

impl Phase {
    /// The phase a connection starts in. The spec allows TLS only with a
    /// fixed-newstyle client: with `Allow` another client is served
    /// plain, with `Require` it is refused (it could only be closed on
    /// its NBD_OPT_EXPORT_NAME anyway).
    pub(crate) fn start(tls: &NbdTls, fixed_newstyle: bool) -> Result<Phase, NbdError> {
        match (tls, fixed_newstyle) {
            (NbdTls::Off, _) | (NbdTls::Allow(_), false) => Ok(Phase::Unoffered),
            (NbdTls::Allow(_), true) => Ok(Phase::Offered { required: false }),
            (NbdTls::Require(_), true) => Ok(Phase::Offered { required: true }),
            (NbdTls::Require(_), false) => Err(NbdError::Protocol(
                "TLS is required and the client does not speak fixed newstyle".to_string(),
            )),
        }
    }

    /// The error every option but NBD_OPT_STARTTLS and NBD_OPT_ABORT gets
    /// in this phase (NBD_REP_ERR_TLS_REQD before a required upgrade),
    /// or None when options are served.
    pub(crate) fn refusal(self, option: u32) -> Option<u32> {
        let exempt = matches!(option, NBD_OPT_STARTTLS | NBD_OPT_ABORT);
        (self == Phase::Offered { required: true } && !exempt).then_some(NBD_REP_ERR_TLS_REQD)
    }

    /// The answer to NBD_OPT_STARTTLS with `data_len` bytes of data:
    /// Ok (NBD_REP_ACK, then the upgrade) or the error reply to send.
    pub(crate) fn starttls(self, data_len: usize) -> Result<(), (u32, &'static str)> {
        match self {
            Phase::Unoffered => Err((NBD_REP_ERR_UNSUP, "TLS is not offered here")),
            Phase::Upgraded => Err((NBD_REP_ERR_INVALID, "TLS is already on")),
            Phase::Offered { .. } if data_len > 0 => {
                Err((NBD_REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data"))
            }
            Phase::Offered { .. } => Ok(()),
        }
    }
}

/// Bytes an OpenSSL session gathers before it writes (a few TLS records).
const PSK_WRITE_BUFFER: usize = 64 * 1024;

/// A connection after the TLS upgrade: an x509 (rustls) or a PSK
/// (OpenSSL) session on the client's stream. A rustls session is
/// kilobytes, boxed; OpenSSL's is on the heap already. rustls gathers
/// small writes into records itself; OpenSSL makes a record (and a
/// system call) of every write, so its writes go through a buffer that
/// turns a batch of replies (a 16-byte header, a 4 KiB read, ...) into
/// full records.
pub(crate) enum TlsConn<S> {
    X509(Box<TlsStream<S>>),
    Psk(BufWriter<SslStream<S>>),
}

/// The TLS server handshake on `stream` with `creds`, after NBD_REP_ACK
/// was sent to NBD_OPT_STARTTLS, and a short description of the session
/// for the logs. Bounded by the caller's handshake timeout.
pub(crate) async fn accept<S: Conn>(
    stream: S,
    creds: &TlsCreds,
) -> Result<(TlsConn<S>, String), NbdError> {
    match creds {
        TlsCreds::X509(config) => {
            let s = TlsAcceptor::from(config.clone())
                .accept(stream)
                .await
                .map_err(|e| NbdError::Tls(e.to_string()))?;
            let (_, session) = s.get_ref();
            let certs = session.peer_certificates().map_or(0, |c| c.len());
            let described = format!(
                "{:?}, {:?}, {certs} client certificate(s)",
                session.protocol_version(),
                session.negotiated_cipher_suite().map(|s| s.suite()),
            );
            Ok((TlsConn::X509(Box::new(s)), described))
        }
        TlsCreds::Psk(config) => {
            let (s, identity) = config.accept(stream).await?;
            let described = format!(
                "{}, {}, PSK identity \"{identity}\"",
                s.ssl().version_str(),
                s.ssl()
                    .current_cipher()
                    .map_or("?", |c| c.standard_name().unwrap_or(c.name())),
            );
            Ok((
                TlsConn::Psk(BufWriter::with_capacity(PSK_WRITE_BUFFER, s)),
                described,
            ))
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsConn<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TlsConn::X509(s) => Pin::new(&mut **s).poll_read(cx, buf),
            TlsConn::Psk(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsConn<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            TlsConn::X509(s) => Pin::new(&mut **s).poll_write(cx, buf),
            TlsConn::Psk(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            TlsConn::X509(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
            TlsConn::Psk(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            TlsConn::X509(s) => s.is_write_vectored(),
            TlsConn::Psk(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TlsConn::X509(s) => Pin::new(&mut **s).poll_flush(cx),
            TlsConn::Psk(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TlsConn::X509(s) => Pin::new(&mut **s).poll_shutdown(cx),
            TlsConn::Psk(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl<S: Conn> Conn for TlsConn<S> {
    type Reader = ReadHalf<TlsConn<S>>;
    type Writer = WriteHalf<TlsConn<S>>;
    /// One TLS session cannot be cut in two: both halves share it (behind
    /// tokio's lock), so requests are still read while replies are written.
    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        tokio::io::split(self)
    }
}

#[cfg(test)]
mod tests;
