//! NBD server protocol layer: handshake, option haggling, transmission phase.
//! Owns the wire format and connection handling; knows nothing about volumes,
//! replication or the cluster: it serves whatever implements `Exports`.
//!
//! * [`codec`]: constants and pure encode/decode functions (re-exported at the root).
//! * [`serve`] / [`serve_connection`]: the server (fixed newstyle only, simple replies only),
//!   over TCP or a Unix socket ([`Listener`], [`Conn`]).
//! * [`NbdTls`]: TLS for a listener (NBD_OPT_STARTTLS; off, allowed or required),
//!   with certificates or pre-shared keys ([`TlsCreds`], [`psk`]).
//! * [`mem`]: an in-memory [`Exports`] implementation for tests and examples.

use std::future::Future;
use std::sync::Arc;

pub mod codec;
pub mod mem;
pub mod psk;
mod server;
mod tls;

pub use codec::*;
pub use psk::{PskConfig, PskError, PskKeys};
pub use server::{serve, serve_connection, Conn, Listener};
pub use tls::{NbdTls, TlsCreds};

/// Error an export reports for one request; mapped onto the NBD error field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IoError {
    #[error("I/O error")]
    Io,
    #[error("no space left")]
    NoSpace,
    #[error("invalid request")]
    Invalid,
    #[error("not permitted")]
    NotPermitted,
    #[error("shutting down")]
    Shutdown,
    #[error("out of memory")]
    NoMem,
}

impl IoError {
    /// The NBD wire error value.
    pub fn to_nbd(self) -> u32 {
        match self {
            IoError::Io => NBD_EIO,
            IoError::NoSpace => NBD_ENOSPC,
            IoError::Invalid => NBD_EINVAL,
            IoError::NotPermitted => NBD_EPERM,
            IoError::Shutdown => NBD_ESHUTDOWN,
            IoError::NoMem => NBD_ENOMEM,
        }
    }

    /// Inverse of [`IoError::to_nbd`]; unknown non-zero values map to `Io`,
    /// zero maps to `None`.
    pub fn from_nbd(v: u32) -> Option<Self> {
        Some(match v {
            NBD_OK => return None,
            NBD_ENOSPC => IoError::NoSpace,
            NBD_EINVAL => IoError::Invalid,
            NBD_EPERM => IoError::NotPermitted,
            NBD_ESHUTDOWN => IoError::Shutdown,
            NBD_ENOMEM => IoError::NoMem,
            _ => IoError::Io,
        })
    }
}

/// One opened export, held for the lifetime of a connection.
///
/// An I/O method may start its work when it is called, and its future owns
/// what it needs: the server calls the methods for the requests of one
/// connection in arrival order, each before the next request is read, and
/// awaits the futures on tasks of their own.
pub trait Export: Send + Sync + 'static {
    fn size(&self) -> u64;
    /// Smallest unit of I/O the export takes, in bytes (a power of two):
    /// advertised in NBD_INFO_BLOCK_SIZE; requests not aligned to it may be
    /// refused with EINVAL.
    fn min_block_size(&self) -> u32 {
        MIN_BLOCK_SIZE
    }
    /// Advertise NBD_FLAG_CAN_MULTI_CONN.
    fn multi_conn(&self) -> bool;
    /// Must return exactly `len` bytes on success.
    fn read(
        &self,
        offset: u64,
        len: u32,
    ) -> impl Future<Output = Result<bytes::Bytes, IoError>> + Send + 'static;
    fn write(
        &self,
        offset: u64,
        data: bytes::Bytes,
        fua: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static;
    fn flush(&self) -> impl Future<Output = Result<(), IoError>> + Send + 'static;
    fn trim(
        &self,
        offset: u64,
        len: u32,
        fua: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static;
    fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        fua: bool,
        may_trim: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static;
    /// A request was read from the client and will be served: called in
    /// arrival order, before any of its work starts, so the export can
    /// tell how many requests are waiting even before their tasks run.
    fn request_started(&self);
    /// The request's answer is queued for the client.
    fn request_ended(&self);
}

/// The set of exports a server offers.
pub trait Exports: Send + Sync + 'static {
    type Export: Export;
    /// Names for NBD_OPT_LIST.
    fn list(&self) -> impl Future<Output = Vec<String>> + Send;
    /// Open by name for OPT_GO/OPT_INFO/EXPORT_NAME; Err(message) =>
    /// NBD_REP_ERR_UNKNOWN with that message. The returned value is held for
    /// the connection's lifetime and dropped when it closes.
    fn open(&self, name: &str) -> impl Future<Output = Result<Self::Export, String>> + Send;
}

impl<T: Export> Export for Arc<T> {
    fn size(&self) -> u64 {
        (**self).size()
    }
    fn multi_conn(&self) -> bool {
        (**self).multi_conn()
    }
    fn read(
        &self,
        offset: u64,
        len: u32,
    ) -> impl Future<Output = Result<bytes::Bytes, IoError>> + Send + 'static {
        (**self).read(offset, len)
    }
    fn write(
        &self,
        offset: u64,
        data: bytes::Bytes,
        fua: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        (**self).write(offset, data, fua)
    }
    fn flush(&self) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        (**self).flush()
    }
    fn trim(
        &self,
        offset: u64,
        len: u32,
        fua: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        (**self).trim(offset, len, fua)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        fua: bool,
        may_trim: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        (**self).write_zeroes(offset, len, fua, may_trim)
    }
    fn request_started(&self) {
        (**self).request_started()
    }
    fn request_ended(&self) {
        (**self).request_ended()
    }
}

/// Why a connection ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The client violated the protocol (bad magic, unknown client flags,
    /// absurd lengths, ...); the connection was closed.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The client closed the connection without NBD_OPT_ABORT / NBD_CMD_DISC.
    #[error("client closed the connection")]
    ClientAborted,
    /// NBD_OPT_EXPORT_NAME named an export that could not be opened (the
    /// protocol has no way to report this but closing the connection).
    #[error("export {name:?} could not be opened: {message}")]
    ExportRejected { name: String, message: String },
    /// The TLS handshake after NBD_OPT_STARTTLS failed (e.g. the client
    /// showed no certificate, or one the configuration does not accept;
    /// an unknown PSK identity, or the wrong key).
    #[error("TLS handshake failed: {0}")]
    Tls(String),
}
