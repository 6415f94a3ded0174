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
//! A returning copy then needs only the union of what its source (any
//! copy in sync) and the copy itself report ([`Request::TrackedRegions`]):
//! its own report adds the writes it had in flight when it went out.
//! The reconciliation of a dead owner's writes sends its copies with a
//! sequence number of their own, so they are tracked like client writes.
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
use shoal_rpc::{Peer, RegionSet, Request, Response, RpcError};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

/// What a plan asks, of whom: the source (an in-sync copy) and the
/// target, each its connection and component.
pub(super) struct Queries {
    pub(super) source: (Arc<Peer>, ComponentId),
    pub(super) target: (Arc<Peer>, ComponentId),
    /// Copy every allocated region (the target was added, or its device
    /// failed), not a delta.
    pub(super) full: bool,
}

impl<C: Control> Loop<C> {
    /// Whether the copies in service must track the regions written: a
    /// data copy of the layout is not in sync.
    pub(super) fn tracking(&self) -> bool {
        self.replicas.iter().any(|r| {
            r.is_data() && !r.layouts.retired() && !matches!(r.mode, Mode::InSync | Mode::Synced)
        })
    }

    /// The questions of the plan to bring copy `idx` back from copy
    /// `src`, or None if either has no connection. By the invariant any
    /// one in-sync copy knows every region written since the epoch began,
    /// so only the source is asked (a copy that does not answer fails the
    /// attempt; asking more would let any of them block it).
    pub(super) fn plan_queries(&self, idx: usize, src: usize) -> Option<Queries> {
        let (s, t) = (&self.replicas[src], &self.replicas[idx]);
        Some(Queries {
            source: (s.peer.clone()?, s.component),
            target: (t.peer.clone()?, t.component),
            full: t.degraded || t.layouts.added(),
        })
    }
}

/// Asks `peer` one question about `component` and waits for the answer.
async fn ask(
    (peer, component): &(Arc<Peer>, ComponentId),
    question: fn(ComponentId) -> Request,
    timeout: Duration,
) -> Result<Response, RpcError> {
    let sent = peer.send(&question(*component), Bytes::new())?;
    Ok(sent.wait(timeout).await?.0)
}

/// The regions to copy, ascending, below `limit` regions: the tracked
/// ones, or (for a full copy, or a tracked set of `All`) the allocated
/// ones.
pub(super) async fn plan(q: Queries, limit: u64, timeout: Duration) -> Result<Vec<u64>, RpcError> {
    let tracked = |component| Request::TrackedRegions { component };
    if !q.full {
        let mut regions = BTreeSet::new();
        let mut all = false;
        for side in [&q.source, &q.target] {
            match ask(side, tracked, timeout).await? {
                Response::Tracked(RegionSet::All) => all = true,
                Response::Tracked(set) if set.is_ordered() => regions.extend(set.regions(limit)),
                other => return Err(unexpected("tracked regions", &other)),
            }
        }
        if !all {
            return Ok(regions.into_iter().collect());
        }
    }
    let allocated = |component| Request::AllocatedRanges { component };
    let mut regions = BTreeSet::new();
    for side in [&q.source, &q.target] {
        let Response::Ranges(v) = ask(side, allocated, timeout).await? else {
            return Err(RpcError::Protocol("expected ranges".into()));
        };
        // Ranges in any order from a peer: each region is inserted once
        // (at most `limit` in all), so no answer makes this loop long.
        let mut next = 0;
        let mut sorted = v;
        sorted.sort_unstable();
        for (off, len) in sorted {
            let first = (off / REGION).max(next);
            let end = off.saturating_add(len).div_ceil(REGION).min(limit);
            regions.extend(first..end);
            next = next.max(end);
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
