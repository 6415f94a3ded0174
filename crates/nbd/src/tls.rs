//! NBD over TLS (the spec's "TLS support": in-session upgrade with
//! NBD_OPT_STARTTLS, fixed newstyle only).
//!
//! * [`NbdTls`]: whether a listener offers TLS, and with which rustls
//!   configuration (which decides, among others, whether a client must
//!   show a certificate).
//! * [`Phase`]: how option haggling treats TLS before and after the
//!   upgrade (the spec's NOTLS, SELECTIVETLS and FORCEDTLS modes).
//! * The TLS server handshake on an accepted connection, and [`Conn`] for
//!   the TLS stream so the transmission phase runs over it unchanged.

use std::sync::Arc;

use rustls::ServerConfig;
use tokio::io::{ReadHalf, WriteHalf};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::codec::*;
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
    Allow(Arc<ServerConfig>),
    /// Nothing but NBD_OPT_STARTTLS and NBD_OPT_ABORT is served before
    /// the upgrade (FORCEDTLS).
    Require(Arc<ServerConfig>),
}

impl NbdTls {
    /// The TLS configuration, unless TLS is off.
    pub fn config(&self) -> Option<&Arc<ServerConfig>> {
        match self {
            NbdTls::Off => None,
            NbdTls::Allow(c) | NbdTls::Require(c) => Some(c),
        }
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

/// The TLS server handshake on `stream`, after NBD_REP_ACK was sent to
/// NBD_OPT_STARTTLS. Bounded by the caller's handshake timeout.
pub(crate) async fn accept<S: Conn>(
    stream: S,
    config: Arc<ServerConfig>,
) -> Result<TlsStream<S>, NbdError> {
    TlsAcceptor::from(config)
        .accept(stream)
        .await
        .map_err(|e| NbdError::Tls(e.to_string()))
}

/// A short description of an established TLS session, for the logs.
pub(crate) fn describe<S>(stream: &TlsStream<S>) -> String {
    let (_, session) = stream.get_ref();
    let certs = session.peer_certificates().map_or(0, |c| c.len());
    format!(
        "{:?}, {:?}, {certs} client certificate(s)",
        session.protocol_version(),
        session.negotiated_cipher_suite().map(|s| s.suite()),
    )
}

impl<S: Conn> Conn for TlsStream<S> {
    type Reader = ReadHalf<TlsStream<S>>;
    type Writer = WriteHalf<TlsStream<S>>;
    /// One TLS session cannot be cut in two: both halves share it (behind
    /// tokio's lock), so requests are still read while replies are written.
    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        tokio::io::split(self)
    }
}

#[cfg(test)]
mod tests;
