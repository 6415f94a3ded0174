//! Typed bodies. postcard is not self-describing: only ever append new
//! variants and fields at the end, and raise [`crate::VERSION`] for anything else.

use serde::{Deserialize, Serialize};
use shoal_model::{ComponentId, DeviceId, Generation, VolumeId};
use std::fmt;

/// A request from one node to another. Data travels in the frame payload,
/// never in the body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Liveness and round-trip probe.
    Ping,
    /// Make sure a component exists on the named device (idempotent).
    CreateComponent {
        component: ComponentId,
        volume: VolumeId,
        device: DeviceId,
        size: u64,
    },
    /// Drop a component and free its space.
    DeleteComponent { component: ComponentId },
    /// Grow a component.
    ResizeComponent { component: ComponentId, size: u64 },
    /// An owner of `generation` takes over the component: from now on the
    /// replica refuses anything older. Answered with [`Response::Activated`].
    Activate {
        component: ComponentId,
        generation: Generation,
    },
    /// Write the payload at `offset`; durable before the reply. `seq`
    /// numbers the owner's writes; the replica remembers the regions of
    /// writes newer than the last [`Request::Barrier`] so that a new owner
    /// can reconcile what an old one left in flight.
    Write {
        component: ComponentId,
        generation: Generation,
        offset: u64,
        seq: u64,
    },
    /// Read `len` bytes at `offset`; the reply's payload holds them.
    Read {
        component: ComponentId,
        generation: Generation,
        offset: u64,
        len: u32,
    },
    /// Make every write acknowledged so far durable (they already are;
    /// kept for stores that ack before sync).
    Flush {
        component: ComponentId,
        generation: Generation,
    },
    /// Zero a range, freeing space where whole chunks are covered. `seq`
    /// as for `Write` (0: not a client write, e.g. a resync's).
    WriteZeroes {
        component: ComponentId,
        generation: Generation,
        offset: u64,
        len: u64,
        seq: u64,
    },
    /// I/O on a volume, sent by a node that serves a client to the volume's
    /// owner. Write data in the payload.
    VolumeIo { volume: VolumeId, op: VolumeOp },
    /// The allocated (offset, len) ranges of a component, for resync.
    AllocatedRanges { component: ComponentId },
    /// Every write with a smaller `seq` is complete on all replicas: forget
    /// their regions.
    Barrier {
        component: ComponentId,
        generation: Generation,
        seq: u64,
    },
    /// CRC-32C of a component's whole logical contents, to check that
    /// replicas are identical. Answered with [`Response::Digest`].
    Digest { component: ComponentId },
    /// Replace the block at `offset` (4 KiB aligned) with the payload, read
    /// by the owner from a healthy copy, if this copy's block still fails
    /// its checksum. Answered with [`Response::Repaired`].
    Repair {
        component: ComponentId,
        generation: Generation,
        offset: u64,
    },
    /// [`Request::Write`] of whole 4 KiB blocks with the CRC-32C of each,
    /// computed by the owner where the data entered: the replica checks
    /// the data against them before it stores it (damage in transit is
    /// refused with `BadRequest`), and the store keeps the same CRCs.
    WriteChecked {
        component: ComponentId,
        generation: Generation,
        offset: u64,
        seq: u64,
        crcs: Vec<u32>,
    },
    /// The owner of `generation` renews its read lease for `lease_ms`
    /// milliseconds (at most [`MAX_LEASE_MS`]): the replica answers `Ok`
    /// only at exactly its own generation (a newer one has not activated
    /// it) and remembers when it granted the lease, so that the activation
    /// of a newer owner reports how long the lease may still run
    /// ([`Response::Activated`]'s `lease_ms`). Changes no data and no
    /// generation.
    Renew {
        component: ComponentId,
        generation: Generation,
        lease_ms: u32,
    },
}

/// The longest read lease an owner may ask for, in milliseconds; also the
/// lease a replica assumes it may have granted just before it started (it
/// keeps its grants in memory only).
pub const MAX_LEASE_MS: u32 = 4_000;

/// Client operations on a whole volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VolumeOp {
    Read {
        offset: u64,
        len: u32,
    },
    Write {
        offset: u64,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u32,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
    },
    /// The block at `offset` of one component was found corrupt (by the
    /// node's scrubber): the owner rewrites it from a healthy copy.
    Repair {
        component: ComponentId,
        offset: u64,
    },
}

/// A reply body; data read travels in the payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Ok,
    /// The payload holds the data read.
    Data,
    /// Activation done; `dirty` lists the regions (offset, len) written
    /// by earlier owners and not known complete on every replica;
    /// `lease_ms`: how long, from this answer, a read lease this replica
    /// granted to an older generation may still be in force anywhere
    /// (clock drift margin included): the new owner serves nothing before
    /// it has passed.
    Activated {
        dirty: Vec<(u64, u64)>,
        lease_ms: u32,
    },
    Ranges(Vec<(u64, u64)>),
    Err(RemoteError),
    Digest {
        crc: u32,
        size: u64,
    },
    /// Answer to [`Request::Repair`]: whether the block was replaced (false
    /// when it had been rewritten since it was found bad).
    Repaired(bool),
}

/// An error the remote side reports; callers branch on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RemoteError {
    /// The request carried an older generation than the replica has seen:
    /// another owner took over.
    StaleGeneration {
        have: Generation,
        got: Generation,
    },
    NoSuchComponent(ComponentId),
    NoSuchDevice(DeviceId),
    NoSpace,
    OutOfRange,
    /// The device failed.
    Io(String),
    /// This node does not own the volume (any more).
    NotOwner {
        volume: VolumeId,
    },
    /// The volume cannot serve now (no quorum); try again later.
    Unavailable(String),
    BadRequest(String),
    /// A block of this copy failed its checksum (byte `offset` of the
    /// component): read it from another copy and repair this one.
    Checksum {
        offset: u64,
    },
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteError::StaleGeneration { have, got } => {
                write!(f, "stale generation {got}: replica is at {have}")
            }
            RemoteError::NoSuchComponent(c) => write!(f, "no component {c} here"),
            RemoteError::NoSuchDevice(d) => write!(f, "no device {d} here"),
            RemoteError::NoSpace => write!(f, "device full"),
            RemoteError::OutOfRange => write!(f, "I/O past the end"),
            RemoteError::Io(e) => write!(f, "device I/O error: {e}"),
            RemoteError::NotOwner { volume } => write!(f, "not the owner of volume {volume}"),
            RemoteError::Unavailable(e) => write!(f, "volume unavailable: {e}"),
            RemoteError::BadRequest(e) => write!(f, "bad request: {e}"),
            RemoteError::Checksum { offset } => {
                write!(f, "checksum mismatch in the block at byte {offset}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req() -> impl Strategy<Value = Request> {
        prop_oneof![
            Just(Request::Ping),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(c, g, o)| Request::Write {
                component: c,
                generation: g,
                offset: o,
                seq: 3,
            }),
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(c, g, o, l)| {
                Request::Read {
                    component: c,
                    generation: g,
                    offset: o,
                    len: l,
                }
            }),
            (any::<u64>(), any::<u64>(), any::<bool>()).prop_map(|(v, o, fua)| Request::VolumeIo {
                volume: v,
                op: VolumeOp::Write { offset: o, fua }
            }),
            (any::<u64>(), any::<u64>()).prop_map(|(c, g)| Request::Activate {
                component: c,
                generation: g
            }),
            (any::<u64>(), any::<u64>(), any::<u32>()).prop_map(|(c, g, l)| Request::Renew {
                component: c,
                generation: g,
                lease_ms: l,
            }),
        ]
    }

    proptest! {
        #[test]
        fn requests_round_trip(r in req()) {
            let b = postcard::to_stdvec(&r).unwrap();
            prop_assert_eq!(postcard::from_bytes::<Request>(&b).unwrap(), r);
        }

        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = postcard::from_bytes::<Request>(&b);
            let _ = postcard::from_bytes::<Response>(&b);
        }
    }
}
