//! Delta resync: which regions a returning copy gets.
//!
//! While any data copy of the volume is out of service, every barrier
//! says `track`: the copies in service add the regions it settles to
//! their *tracked* set, kept on their devices until a barrier without
//! `track` (sent once every copy is in sync again) empties it. So, at any
//! moment, each copy in service holds in its tracked set, its dirty
//! writes and its marks every region written since the first copy went
//! out (the tracking epoch), across owner changes and restarts.
//!
//! A returning copy then needs only the union of what the copies in sync
//! and the copy itself report ([`Request::TrackedRegions`]): its own
//! report adds the writes it had in flight when it went out (its marks).
//! A copy created empty reports every region (its tracked set starts
//! `All`), a copy whose device failed or that a change added is copied in
//! full, and a set too large to keep one by one is `All` too: then the
//! regions allocated on the source or the target are copied, as before.
//!
//! A copy brought back must keep the invariant for a later return: before
//! anything is copied to it, it tracks the regions planned for it
//! ([`Request::Track`]), so that it may serve as the source of a copy that
//! is still out.

use super::replica::Mode;
use super::Loop;
use crate::{Control, REGION};
use bytes::Bytes;
use shoal_model::{ComponentId, Generation};
use shoal_rpc::{Peer, PendingReply, RegionSet, Request, Response, RpcError};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

/// A request sent (or not) to one copy.
type Sent = Result<PendingReply, RpcError>;

/// The questions a plan waits for: the allocated ranges of the source
/// and the target, and, for a delta, the tracked regions of every copy in
/// sync and of the target.
pub(super) struct Queries {
    pub(super) allocated: Vec<Sent>,
    pub(super) tracked: Option<Vec<Sent>>,
}

impl<C: Control> Loop<C> {
    /// Whether the copies in service must track the regions written: a
    /// data copy of the layout is not in sync.
    pub(super) fn tracking(&self) -> bool {
        self.replicas.iter().any(|r| {
            r.is_data() && !r.layouts.retired() && !matches!(r.mode, Mode::InSync | Mode::Synced)
        })
    }

    /// Sends the questions of the plan to bring copy `idx` back from
    /// copy `src`: a full copy for one that a change added or whose device
    /// failed, else a delta.
    pub(super) fn ask_plan(&self, idx: usize, src: usize) -> Queries {
        let send = |i: usize, req: Request| -> Sent {
            match &self.replicas[i].peer {
                Some(p) => p.send(&req, Bytes::new()),
                None => Err(RpcError::Closed),
            }
        };
        let allocated = [src, idx]
            .into_iter()
            .map(|i| {
                let component = self.replicas[i].component;
                send(i, Request::AllocatedRanges { component })
            })
            .collect();
        let t = &self.replicas[idx];
        let full = t.degraded || t.layouts.added();
        let tracked = (!full).then(|| {
            (0..self.replicas.len())
                .filter(|&i| {
                    i == idx
                        || (self.replicas[i].is_data() && self.replicas[i].mode == Mode::InSync)
                })
                .map(|i| {
                    let component = self.replicas[i].component;
                    send(i, Request::TrackedRegions { component })
                })
                .collect()
        });
        Queries { allocated, tracked }
    }
}

/// The regions to copy, ascending, below `limit` regions: the tracked
/// ones, or (for a full copy, or a tracked set of `All`) the allocated ones.
pub(super) async fn plan(q: Queries, limit: u64, timeout: Duration) -> Result<Vec<u64>, RpcError> {
    if let Some(tracked) = q.tracked {
        let mut regions = BTreeSet::new();
        let mut all = false;
        for t in tracked {
            match t?.wait(timeout).await? {
                (Response::Tracked(RegionSet::All), _) => all = true,
                (Response::Tracked(set), _) if set.is_ordered() => {
                    regions.extend(set.regions(limit))
                }
                (other, _) => return Err(unexpected("tracked regions", &other)),
            }
        }
        if !all {
            return Ok(regions.into_iter().collect());
        }
    }
    let mut regions = BTreeSet::new();
    for a in q.allocated {
        let (Response::Ranges(v), _) = a?.wait(timeout).await? else {
            return Err(RpcError::Protocol("expected ranges".into()));
        };
        for (off, len) in v {
            let end = off.saturating_add(len).div_ceil(REGION).min(limit);
            regions.extend(off / REGION..end);
        }
    }
    Ok(regions.into_iter().collect())
}

/// Has the target track the regions planned for it, and waits until that
/// is durable: before a region is copied, so that once in sync it holds
/// what its peers hold.
pub(super) async fn seed(
    peer: Arc<Peer>,
    (component, generation): (ComponentId, Generation),
    regions: &[u64],
    timeout: Duration,
) -> Result<(), RpcError> {
    let track = Request::Track {
        component,
        generation,
        regions: RegionSet::from_regions(regions.iter().copied()),
    };
    match peer.send(&track, Bytes::new())?.wait(timeout).await? {
        (Response::Ok, _) => Ok(()),
        (other, _) => Err(unexpected("track", &other)),
    }
}

fn unexpected(what: &str, got: &Response) -> RpcError {
    RpcError::Protocol(format!("unexpected reply to {what}: {got:?}"))
}
