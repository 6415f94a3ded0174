//! Reconciling what a dead owner left in flight, in the background: the
//! regions some copy remembers as possibly half-written (its dirty marks)
//! are copied from one chosen in-sync copy, the *source*, to the other
//! in-sync copies while the volume serves. Until a region is copied, reads
//! of it go to the source only (the local read route is withdrawn unless
//! the local copy is the source), so that every client sees one version
//! of a write that was in flight at the crash; writes go to every copy as
//! always. A region being copied holds writes to it back from the read at
//! the source until the copies are queued, as a resync step does, so a
//! newer write is never overwritten by the copy.
//!
//! No barrier is sent while regions are left: a barrier of this owner's
//! generation would clear the copies' marks of the dead owner's writes,
//! and an owner that dies mid-way must leave them to its successor. No
//! resync starts meanwhile either (its copy would take a region not yet
//! reconciled from whichever copy it reads). A source that fails stops
//! the owner: the next one reconciles afresh from another source, since
//! the marks are all still there.

use super::replica::Mode;
use super::{Flow, Internal, Loop};
use crate::{Control, Event, REGION};
use bytes::Bytes;
use shoal_rpc::{PendingReply, Request, RpcError};
use std::collections::BTreeSet;
use std::time::Instant;

/// The reconciliation under way.
pub(super) struct Reconcile {
    /// The in-sync copy whose content wins.
    pub(super) source: usize,
    /// Regions not yet copied (the one being copied included).
    pub(super) regions: BTreeSet<u64>,
    /// The region being copied: read from the source, its lock held.
    pub(super) current: Option<u64>,
    pub(super) started: Instant,
}

impl<C: Control> Loop<C> {
    /// Starts reconciling `dirty` regions from the source chosen: the
    /// local in-sync copy if there is one (reads stay local), else the
    /// first. Nothing to do with fewer than two in-sync copies.
    pub(super) fn start_reconcile(&mut self, dirty: BTreeSet<u64>) {
        let size = self.size;
        let regions: BTreeSet<u64> = dirty.into_iter().filter(|r| r * REGION < size).collect();
        let insync: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].mode == Mode::InSync && self.replicas[i].peer.is_some())
            .collect();
        if regions.is_empty() || insync.len() < 2 {
            return;
        }
        let source = insync
            .iter()
            .copied()
            .find(|&i| self.replicas[i].node == self.cfg.node)
            .unwrap_or(insync[0]);
        tracing::info!(
            volume = self.volume,
            regions = regions.len(),
            "reconciling regions left in flight, in the background"
        );
        self.reconcile = Some(Reconcile {
            source,
            regions,
            current: None,
            started: Instant::now(),
        });
        self.reconcile_next();
    }

    /// The source reads of `(offset, len)` must come from while it is not
    /// yet reconciled, if any.
    pub(super) fn pinned_source(&self, offset: u64, len: u64) -> Option<usize> {
        let rc = self.reconcile.as_ref()?;
        let (first, last) = (offset / REGION, (offset + len.max(1) - 1) / REGION);
        rc.regions.range(first..=last).next().map(|_| rc.source)
    }

    /// Copies the next region, or ends once none is left.
    fn reconcile_next(&mut self) {
        let Some(rc) = &mut self.reconcile else {
            return;
        };
        let Some(&region) = rc.regions.iter().next() else {
            tracing::info!(
                volume = self.volume,
                took = ?rc.started.elapsed(),
                "regions left in flight reconciled"
            );
            self.reconcile = None;
            self.publish_status();
            return;
        };
        rc.current = Some(region);
        let source = rc.source;
        let off = region * REGION;
        let len = REGION.min(self.size - off);
        debug_assert!(self.locks.is_empty(), "reconcile step while a lock is held");
        self.locks.push((off, off + len));
        let read = self.read_region(source, off, len);
        self.spawn_report(async move {
            let result = read.await;
            Internal::ReconcileRead { region, result }
        });
    }

    /// A region was read from the source: queue it to every other in-sync
    /// copy (ahead of any later write), release the region, go on.
    pub(super) fn reconcile_read(&mut self, region: u64, result: Result<Bytes, RpcError>) -> Flow {
        let Some(rc) = &mut self.reconcile else {
            return Flow::Continue;
        };
        if rc.current != Some(region) {
            return Flow::Continue;
        }
        let source = rc.source;
        let data = match result {
            Ok(d) if d.len() as u64 == REGION.min(self.size - region * REGION) => d,
            Ok(_) | Err(_) => {
                tracing::warn!(
                    volume = self.volume,
                    "the reconciliation's source failed; the owner steps down so that the \
                     next one reconciles from another copy"
                );
                let _ = self.tx.send(Event::Stop);
                return Flow::Continue;
            }
        };
        let mut sent: Vec<(usize, Result<PendingReply, RpcError>)> = Vec::new();
        // A sequence number of its own, as a client write's: the copies
        // mark the region dirty, and the first barrier after the
        // reconciliation settles it, tracked if a copy is out by then
        // (`super::delta`).
        let seq = self.next_seq;
        self.next_seq += 1;
        for i in self.targets().iter().filter(|&i| i != source) {
            let r = &self.replicas[i];
            let Some(p) = &r.peer else { continue };
            let write = Request::Write {
                component: r.component,
                generation: self.generation,
                offset: region * REGION,
                seq,
            };
            sent.push((i, p.send(&write, data.clone())));
        }
        if let Some(rc) = &mut self.reconcile {
            rc.regions.remove(&region);
            rc.current = None;
        }
        self.locks.clear();
        self.unblock();
        let timeout = self.cfg.io_timeout;
        self.spawn_report(async move {
            let mut failed = Vec::new();
            for (i, s) in sent {
                let r = match s {
                    Ok(p) => p.wait(timeout).await.map(|_| ()),
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    failed.push((i, e));
                }
            }
            Internal::ReconcileWritten { failed }
        });
        self.reconcile_next();
        Flow::Continue
    }

    /// The copies' answers to one region's copy: those that failed leave
    /// service (they may hold the dead owner's half-written region).
    pub(super) fn reconcile_written(&mut self, failed: Vec<(usize, RpcError)>) -> Flow {
        for (i, e) in failed {
            if super::health::is_stale(&e) {
                return Flow::Stop;
            }
            self.fail(i, super::health::state_for(&e));
        }
        Flow::Continue
    }
}
