//! # shoal-rpc: the peer-to-peer data path between nodes
//!
//! Framing, message types and connections for the traffic an owner sends to
//! the replicas of its volumes (and a node sends to the owner of a volume it
//! forwards for). Owns the wire format; knows nothing about how requests are
//! executed: the node supplies a [`Handler`].
//!
//! Wire format (see `docs/rpc-format.md`): each frame is a fixed 32-byte
//! little-endian header, a postcard-encoded body, then raw payload bytes.
//! Every connection is proven before its first frame is read
//! ([`PeerAuth`]).
//! Frames on one connection are handled in the order they were sent; the
//! replies may come back in any order, matched by request id.

mod frame;
mod limits;
mod message;
mod peer;
mod server;

pub use frame::{FrameError, Header, HEADER_LEN, MAGIC, MAX_BODY, MAX_PAYLOAD, VERSION};
pub use limits::{AddressSlot, PerAddress};
pub use message::{
    trim_span, RegionSet, RemoteError, Request, Response, VolumeOp, MAX_LEASE_MS, MAX_REGION_RUNS,
    MAX_TRIM_RANGES, REGION_BYTES,
};
pub use peer::{register_local, Peer, PendingReply};
pub use server::{serve, Handler, Reply};

/// How connections between nodes are proven.
#[derive(Clone)]
pub enum PeerAuth {
    /// Mutual TLS with the cluster's certificates, then TLS or the
    /// authenticated bare stream (see `shoal_tls`). Every node serves and
    /// connects this way.
    Members(shoal_tls::PeerSecurity),
    /// No proof at all: for tests of this crate and of the owner, against
    /// servers they start themselves. A node never serves this way.
    Unauthenticated,
}

impl std::fmt::Debug for PeerAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerAuth::Members(s) => write!(f, "Members(encrypt: {})", s.encrypt),
            PeerAuth::Unauthenticated => f.write_str("Unauthenticated"),
        }
    }
}

use std::time::Duration;

/// Read buffer of a connection, in bytes: holds many small frames (headers
/// and bodies of pipelined requests), so each costs no read call of its
/// own; payloads larger than it are read straight into their buffers.
pub(crate) const READ_BUFFER: usize = 64 << 10;

/// Most memory a frame's buffer grows by before its next bytes arrive, in
/// bytes: a header that declares a large body or payload costs nothing
/// until the bytes come.
pub(crate) const GROW_STEP_BYTES: usize = 1 << 20;

/// Reads exactly `n` bytes into a fresh buffer, without zeroing it first.
/// The buffer grows with the bytes that arrive (by at most
/// [`GROW_STEP_BYTES`] ahead of them), never to `n` up front.
pub(crate) async fn read_payload<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    n: usize,
) -> std::io::Result<bytes::Bytes> {
    use tokio::io::AsyncReadExt;
    let mut buf = bytes::BytesMut::with_capacity(n.min(GROW_STEP_BYTES));
    while buf.len() < n {
        let want = n - buf.len();
        if buf.capacity() == buf.len() {
            buf.reserve(want.min(GROW_STEP_BYTES));
        }
        let room = (buf.capacity() - buf.len()).min(want);
        if (&mut *r).take(room as u64).read_buf(&mut buf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(buf.freeze())
}

/// Why a call to a peer did not produce a reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RpcError {
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error("connection to peer closed")]
    Closed,
    #[error("peer did not answer within {0:?}")]
    Timeout(Duration),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("{0}")]
    Remote(RemoteError),
}
