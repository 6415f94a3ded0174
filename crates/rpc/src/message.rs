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
    /// Grow a component to `size` bytes; a component as large or larger
    /// is left as it is (never shrunk).
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
    /// their regions. With `track`, a copy of the volume is out of service:
    /// the replica first adds those regions to the component's tracked set
    /// (durable, kept until a barrier without `track`), so that the copy
    /// gets only them when it returns ([`Request::TrackedRegions`]);
    /// without it, the tracked set is emptied (every copy is in sync).
    Barrier {
        component: ComponentId,
        generation: Generation,
        seq: u64,
        track: bool,
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
    /// The regions a copy of this component's volume that was out of
    /// service may lack: the component's tracked regions (see
    /// [`Request::Barrier`]) and those of writes no barrier covered yet
    /// (regions marked on the device when the node started count as such).
    /// Answered with
    /// [`Response::Tracked`]. Reads only.
    TrackedRegions { component: ComponentId },
    /// Adds `regions` to the component's tracked set (fenced by
    /// `generation`): sent to a resync target before it is copied to, so
    /// that once in sync it remembers the regions written since its peers
    /// started tracking, as they do.
    Track {
        component: ComponentId,
        generation: Generation,
        regions: RegionSet,
    },
    /// The bytes the component's written blocks take on its device, for
    /// capacity reports. Answered with [`Response::Usage`]. Reads a
    /// counter only: no ordering with the component's writes.
    Usage { component: ComponentId },
    /// Zero (trim) each of `ranges`, (offset, len) in bytes, in order and
    /// apart, at most [`MAX_TRIM_RANGES`]: many small trims in one
    /// request, as an erasure-coded volume's owner sends for the blocks a
    /// stripe took off its performance leg. `seq` as for `Write`.
    TrimRanges {
        component: ComponentId,
        generation: Generation,
        ranges: Vec<(u64, u64)>,
        seq: u64,
    },
}

/// Ranges one [`Request::TrimRanges`] may carry: a stripe's blocks
/// (at most 124 for 4+1) in one request, with room to spare; 4 KiB of
/// body.
pub const MAX_TRIM_RANGES: usize = 256;

/// Whether `ranges` may be one [`Request::TrimRanges`]: at most
/// [`MAX_TRIM_RANGES`], none empty, in order and apart, none past
/// `u64::MAX`. Answers the span they cover, (first byte, end).
pub fn trim_span(ranges: &[(u64, u64)]) -> Option<(u64, u64)> {
    if ranges.is_empty() || ranges.len() > MAX_TRIM_RANGES {
        return None;
    }
    let mut end = 0u64;
    for (i, &(off, len)) in ranges.iter().enumerate() {
        if len == 0 || (i > 0 && off < end) {
            return None;
        }
        end = off.checked_add(len)?;
    }
    Some((ranges[0].0, end))
}

/// A set of a component's regions ([`REGION_BYTES`] each).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegionSet {
    /// Every region of the component.
    All,
    /// Runs of regions, (first region, count), ascending and disjoint; at
    /// most [`MAX_REGION_RUNS`] (a larger set is sent as `All`).
    Runs(Vec<(u64, u64)>),
}

/// Bytes of one region of a [`RegionSet`]: the owner's resync unit and the
/// store's mark unit.
pub const REGION_BYTES: u64 = 1 << 20;

/// The most runs a [`RegionSet`] carries, so that its body stays far
/// below [`crate::MAX_BODY`] (a run takes at most 20 bytes).
pub const MAX_REGION_RUNS: usize = 16_384;

impl RegionSet {
    /// The set of `regions` (any order, repeats allowed); `All` past
    /// [`MAX_REGION_RUNS`] runs.
    pub fn from_regions(regions: impl IntoIterator<Item = u64>) -> RegionSet {
        let mut sorted: Vec<u64> = regions.into_iter().collect();
        sorted.sort_unstable();
        sorted.dedup();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for r in sorted {
            match runs.last_mut() {
                Some((first, count)) if *first + *count == r => *count += 1,
                _ => {
                    if runs.len() == MAX_REGION_RUNS {
                        return RegionSet::All;
                    }
                    runs.push((r, 1));
                }
            }
        }
        RegionSet::Runs(runs)
    }

    /// Whether the runs are ascending and disjoint, as a set built by
    /// [`RegionSet::from_regions`] is: one from a peer that is not is
    /// refused.
    pub fn is_ordered(&self) -> bool {
        match self {
            RegionSet::All => true,
            RegionSet::Runs(v) => v
                .windows(2)
                .all(|w| w[0].0.checked_add(w[0].1).is_some_and(|end| end <= w[1].0)),
        }
    }

    /// The regions of the set below `limit` regions, ascending, each
    /// once (`All`: every one). A set from a peer is not trusted to be in
    /// order: runs are cut at `limit` and where an earlier one ended, so
    /// that at most `limit` regions come out, whatever it holds.
    pub fn regions(&self, limit: u64) -> impl Iterator<Item = u64> + '_ {
        let runs: Box<dyn Iterator<Item = (u64, u64)>> = match self {
            RegionSet::All => Box::new(std::iter::once((0, limit))),
            RegionSet::Runs(v) => Box::new(v.iter().copied()),
        };
        let mut next = 0u64;
        runs.flat_map(move |(first, count)| {
            let start = first.max(next).min(limit);
            let end = first.saturating_add(count).min(limit).max(start);
            next = next.max(end);
            start..end
        })
    }
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
    /// Answer to [`Request::TrackedRegions`].
    Tracked(RegionSet),
    /// Answer to [`Request::Usage`].
    Usage {
        allocated_bytes: u64,
    },
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
            (
                any::<u64>(),
                prop::collection::vec((any::<u64>(), any::<u64>()), 0..8)
            )
                .prop_map(|(c, ranges)| Request::TrimRanges {
                    component: c,
                    generation: 2,
                    ranges,
                    seq: 9,
                }),
        ]
    }

    proptest! {
        /// `trim_span` accepts exactly 1 to `MAX_TRIM_RANGES` ranges, none
        /// empty, each after the end of the one before, none past
        /// `u64::MAX`; and answers their first byte and end.
        #[test]
        fn trim_spans_accept_only_ordered_apart_ranges(
            ranges in prop::collection::vec((0u64..1 << 20, 0u64..64), 0..300),
        ) {
            let ok = !ranges.is_empty()
                && ranges.len() <= MAX_TRIM_RANGES
                && ranges.iter().all(|r| r.1 > 0)
                && ranges.windows(2).all(|w| w[1].0 >= w[0].0 + w[0].1);
            let span = trim_span(&ranges);
            prop_assert_eq!(span.is_some(), ok);
            if let Some((first, end)) = span {
                let last = ranges[ranges.len() - 1];
                prop_assert_eq!((first, end), (ranges[0].0, last.0 + last.1));
            }
        }
    }

    #[test]
    fn a_trim_span_past_the_last_byte_is_refused() {
        assert_eq!(trim_span(&[(u64::MAX - 1, 2)]), None);
        assert_eq!(
            trim_span(&[(u64::MAX - 1, 1)]),
            Some((u64::MAX - 1, u64::MAX))
        );
    }

    #[test]
    fn a_region_set_past_its_run_bound_is_all_and_a_peer_s_runs_stop_at_the_limit() {
        let every_other = (0..2 * MAX_REGION_RUNS as u64 + 2).step_by(2);
        assert_eq!(RegionSet::from_regions(every_other), RegionSet::All);
        let huge = RegionSet::Runs(vec![(3, u64::MAX), (u64::MAX - 1, u64::MAX), (0, u64::MAX)]);
        assert_eq!(huge.regions(6).collect::<Vec<_>>(), vec![3, 4, 5]);
        let overlapping = RegionSet::Runs(vec![(1, 3), (2, 3), (0, 1)]);
        assert_eq!(
            overlapping.regions(10).collect::<Vec<_>>(),
            vec![1, 2, 3, 4]
        );
        assert!(!overlapping.is_ordered());
        assert!(!huge.is_ordered());
        assert!(RegionSet::Runs(vec![(0, 2), (2, 1), (9, 1)]).is_ordered());
        assert_eq!(RegionSet::All.regions(3).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    proptest! {
        #[test]
        fn requests_round_trip(r in req()) {
            let b = postcard::to_stdvec(&r).unwrap();
            prop_assert_eq!(postcard::from_bytes::<Request>(&b).unwrap(), r);
        }

        #[test]
        fn region_sets_hold_exactly_their_regions(
            v in proptest::collection::vec(0u64..4096, 0..512),
            limit in 0u64..5000,
        ) {
            let set = RegionSet::from_regions(v.iter().copied());
            let RegionSet::Runs(runs) = &set else {
                return Err(TestCaseError::fail("512 regions are far from the run bound"));
            };
            prop_assert!(runs.windows(2).all(|w| w[0].0 + w[0].1 < w[1].0), "disjoint, apart, ascending");
            prop_assert!(set.is_ordered());
            let mut want: Vec<u64> = v.into_iter().filter(|&r| r < limit).collect();
            want.sort_unstable();
            want.dedup();
            prop_assert_eq!(set.regions(limit).collect::<Vec<_>>(), want);
            let b = postcard::to_stdvec(&Response::Tracked(set.clone())).unwrap();
            prop_assert_eq!(postcard::from_bytes::<Response>(&b).unwrap(), Response::Tracked(set));
        }

        #[test]
        fn garbage_never_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = postcard::from_bytes::<Request>(&b);
            let _ = postcard::from_bytes::<Response>(&b);
        }
    }
}
