//! Resync: bringing back a copy that was out of service while writes go
//! on. One at a time, in phases: raise the generation to fence frames of
//! older sessions and have the copies in service take it (reclaim),
//! activate the copy and record it resyncing (revive; from here it
//! receives every write), ask both sides what is allocated (plan), copy
//! those regions, [`COPY_REGIONS_IN_FLIGHT`] at a time, each read from
//! the in-sync copies in turn, while writes to a region being read wait
//! (copy), and record the copy active (finish). Any failure aborts the
//! attempt; the tick tries again later. Each attempt has a number its reports carry, so that a
//! late report of an aborted attempt never acts on a later one.
//!
//! An attempt aborted while finishing is [`Abandoned`]: the directory may
//! still record the target active, so the target stays failing (writes
//! that skip it wait) until that request answered, is recorded absent (or
//! degraded) only then, and no other attempt starts meanwhile.

use super::activation::activate;
use super::delta;
use super::health::state_for;
use super::replica::Mode;
use super::{Flow, Internal, Loop, DEGRADED_RETRY_TICKS, RESYNC_RETRY_TICKS};
use crate::pace::Pace;
use crate::{Control, ControlError, REGION};
use bytes::Bytes;
use shoal_model::{ComponentState, Generation, BLOCK_SIZE};
use shoal_rpc::{Peer, PendingReply, Request, RpcError};
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Regions a resync copies at once: each is read from the next in-sync
/// copy in turn, so the sources' disks and the links work in parallel,
/// and the target's disk sees several writes at once; each holds a region
/// (1 MiB) of buffer on the owner while it is read and written.
pub(crate) const COPY_REGIONS_IN_FLIGHT: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ResyncPhase {
    Reclaiming,
    Reviving,
    Planning,
    Copying,
    Finishing,
}

pub(super) struct Resync {
    /// Numbers this attempt among all of the loop's.
    pub(super) attempt: u64,
    /// The copy brought back.
    pub(super) idx: usize,
    /// The in-sync copy the plan asks, chosen once the target is revived
    /// (regions are read from every in-sync copy in turn).
    pub(super) source: Option<usize>,
    pub(super) phase: ResyncPhase,
    /// Regions left to copy, in order.
    pub(super) regions: VecDeque<u64>,
    /// Regions being read or written (at most
    /// [`COPY_REGIONS_IN_FLIGHT`]).
    pub(super) in_flight: BTreeSet<u64>,
    /// Bytes to copy in all, once planned, begun and copied so far.
    pub(super) bytes_total: u64,
    pub(super) bytes_started: u64,
    pub(super) bytes_done: u64,
    /// A wake-up for the pace is due ([`Internal::CopyPaced`]).
    pub(super) pace_wait: bool,
    pub(super) started: Instant,
    /// Under an adaptive limit, when the next region may start.
    pub(super) next_due: Option<Instant>,
}

/// An attempt aborted while the directory was being asked to record its
/// target active: the target is failing until that request answers
/// ([`Internal::ResyncDone`]), then recorded in `state`.
pub(super) struct Abandoned {
    pub(super) attempt: u64,
    pub(super) idx: usize,
    /// Absent, or degraded if the target failed with a device error.
    pub(super) state: ComponentState,
}

/// Why a copy could not be revived.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReviveError {
    #[error("{0}")]
    Activate(RpcError),
    #[error("{0}")]
    Record(ControlError),
}

/// Waits for a request sent (or not) to a copy.
async fn answer(
    sent: Option<Result<PendingReply, RpcError>>,
    timeout: Duration,
) -> Result<Bytes, RpcError> {
    match sent {
        Some(Ok(p)) => p.wait(timeout).await.map(|(_, d)| d),
        Some(Err(e)) => Err(e),
        None => Err(RpcError::Closed),
    }
}

impl<C: Control> Loop<C> {
    /// Sends copy `src` a read of `len` bytes at `off` (a region a resync
    /// or the reconciliation copies) and returns its answer to come.
    pub(super) fn read_region(
        &self,
        src: usize,
        off: u64,
        len: u64,
    ) -> impl std::future::Future<Output = Result<Bytes, RpcError>> + Send + 'static {
        let s = &self.replicas[src];
        let read = Request::Read {
            component: s.component,
            generation: self.generation,
            offset: off,
            len: len as u32,
        };
        let sent = s.peer.as_ref().map(|p| p.send(&read, Bytes::new()));
        answer(sent, self.cfg.io_timeout)
    }

    /// Whether `attempt` is the resync under way.
    fn is_current(&self, attempt: u64) -> bool {
        self.resync.as_ref().is_some_and(|rs| rs.attempt == attempt)
    }

    /// On a tick: starts bringing back one copy that is out, once the
    /// pause after a failed attempt is over.
    pub(super) fn consider_resync(&mut self) {
        if self.resync_backoff > 0 {
            self.resync_backoff -= 1;
            return;
        }
        // Nor while a lost copy is being reconnected: a raise of the
        // generation now could overtake its activation.
        if self.resync.is_some()
            || self.abandoned.is_some()
            || self.reconcile.is_some()
            || self.reconnect_reclaim
            || self.replicas.iter().any(|r| r.reconnecting)
        {
            return;
        }
        // A copy of the volume's layout first (it restores protection),
        // then one a change added; never one the change drops, and one
        // whose device failed only when it cannot be rebuilt elsewhere
        // (its node may have reopened the store since).
        let candidate = (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.is_data()
                    && r.mode == Mode::Out
                    && r.node_up
                    && r.layouts.new
                    && (!r.degraded || self.rebuild.problem.is_some())
            })
            .min_by_key(|&i| !self.replicas[i].layouts.old);
        if let Some(idx) = candidate {
            self.start_resync(idx);
        }
    }

    fn start_resync(&mut self, idx: usize) {
        tracing::info!(
            volume = self.volume,
            component = self.replicas[idx].component,
            "starting resync"
        );
        self.resync_attempts += 1;
        let attempt = self.resync_attempts;
        self.resync = Some(Resync {
            attempt,
            idx,
            source: None,
            phase: ResyncPhase::Reclaiming,
            regions: VecDeque::new(),
            in_flight: BTreeSet::new(),
            bytes_total: 0,
            bytes_started: 0,
            bytes_done: 0,
            pace_wait: false,
            started: Instant::now(),
            next_due: None,
        });
        // A new generation fences frames of older sessions still queued
        // towards the returning replica.
        let control = self.control.clone();
        let (volume, generation) = (self.volume, self.generation);
        self.spawn_report(async move {
            let result = control.reclaim(volume, generation).await;
            Internal::Reclaimed { attempt, result }
        });
    }

    pub(super) fn reclaimed(
        &mut self,
        attempt: u64,
        result: Result<Generation, ControlError>,
    ) -> Flow {
        match result {
            Ok(g) => {
                self.set_generation(g);
                self.fence_in_service();
                if self.is_current(attempt) {
                    self.revive();
                }
            }
            Err(ControlError::Conflict) => return Flow::Stop,
            Err(e @ (ControlError::Unavailable(_) | ControlError::Refused(_))) => {
                tracing::warn!(volume = self.volume, "reclaim failed: {e}");
                if self.is_current(attempt) {
                    self.abort_resync();
                }
            }
        }
        Flow::Continue
    }

    /// Has every copy in service take the generation just raised, ahead of
    /// anything sent to it under that generation: a replica refuses reads
    /// under a generation it has not taken (from an activation or a write).
    pub(super) fn fence_in_service(&self) {
        for i in self.targets().iter() {
            let r = &self.replicas[i];
            let flush = Request::Flush {
                component: r.component,
                generation: self.generation,
            };
            if let Some(p) = &r.peer {
                let _ = p.send(&flush, Bytes::new());
            }
        }
    }

    /// Activates the target under the new generation and records it
    /// resyncing (one a change added: reconfiguring, as the commit wants
    /// it).
    fn revive(&mut self) {
        let Some(rs) = &mut self.resync else { return };
        rs.phase = ResyncPhase::Reviving;
        let attempt = rs.attempt;
        let tmp = self.replicas[rs.idx].detached();
        let state = if tmp.layouts.added() {
            ComponentState::Reconfiguring
        } else {
            ComponentState::Resyncing
        };
        let (volume, size, generation, timeout) =
            (self.volume, self.size, self.generation, self.cfg.io_timeout);
        let control = self.control.clone();
        let auth = self.cfg.peer_auth.clone();
        self.spawn_report(async move {
            let peer = async {
                let peer = activate(&tmp, &auth, volume, size, generation, timeout)
                    .await
                    .map_err(ReviveError::Activate)?
                    .peer;
                control
                    .set_component_state(volume, tmp.component, state, generation)
                    .await
                    .map_err(ReviveError::Record)?;
                Ok(peer)
            }
            .await;
            Internal::Revived { attempt, peer }
        });
    }

    /// The target is back: from now on it receives every write; ask both
    /// sides what is allocated, in order after all writes sent so far.
    pub(super) fn revived(&mut self, attempt: u64, peer: Result<Arc<Peer>, ReviveError>) -> Flow {
        if matches!(peer, Err(ReviveError::Record(ControlError::Conflict))) {
            return Flow::Stop;
        }
        if !self.is_current(attempt) {
            return Flow::Continue;
        }
        let peer = match peer {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(volume = self.volume, "resync: cannot revive replica: {e}");
                self.abort_resync();
                return Flow::Continue;
            }
        };
        let source = self
            .replicas
            .iter()
            .position(|r| r.mode == Mode::InSync && r.peer.is_some());
        let (Some(src), Some(rs)) = (source, &mut self.resync) else {
            self.abort_resync();
            return Flow::Continue;
        };
        rs.source = Some(src);
        rs.phase = ResyncPhase::Planning;
        let idx = rs.idx;
        let target = &mut self.replicas[idx];
        target.mode = Mode::Resyncing;
        target.peer = Some(peer.clone());
        let Some(queries) = self.plan_queries(idx, src) else {
            self.abort_resync();
            return Flow::Continue;
        };
        let seeded = (self.replicas[idx].component, self.generation);
        let (timeout, limit) = (self.cfg.io_timeout, self.size.div_ceil(REGION));
        self.spawn_report(async move {
            let regions = async {
                let regions = delta::plan(queries, limit, timeout).await?;
                delta::seed(peer, seeded, &regions, timeout).await?;
                Ok(regions)
            }
            .await;
            Internal::ResyncPlan { attempt, regions }
        });
        Flow::Continue
    }

    pub(super) fn planned(&mut self, attempt: u64, regions: Result<Vec<u64>, RpcError>) -> Flow {
        if !self.is_current(attempt) {
            return Flow::Continue;
        }
        match regions {
            Ok(regions) => {
                tracing::info!(
                    volume = self.volume,
                    regions = regions.len(),
                    "resync copying"
                );
                let size = self.size;
                if let Some(rs) = &mut self.resync {
                    rs.bytes_total = regions
                        .iter()
                        .map(|r| REGION.min(size.saturating_sub(r * REGION)))
                        .sum();
                    rs.regions = regions.into();
                    rs.phase = ResyncPhase::Copying;
                }
                self.copy_next();
            }
            Err(e) => {
                tracing::warn!(volume = self.volume, "resync plan failed: {e}");
                self.abort_resync();
            }
        }
        Flow::Continue
    }

    /// On a tick: feeds the adaptive pace the clients' latencies since
    /// the last one and what the copy moved meanwhile.
    pub(super) fn feed_pace(&mut self) {
        let window = self.latency.take();
        let copied = std::mem::take(&mut self.copied_since_tick);
        let copying = self
            .resync
            .as_ref()
            .is_some_and(|rs| rs.phase == ResyncPhase::Copying);
        let before = self.adaptive.pace();
        self.adaptive.tick(&window, copied, copying, self.cfg.tick);
        let after = self.adaptive.pace();
        if after != before && copying {
            tracing::debug!(
                volume = self.volume,
                pace = ?after,
                baseline_us = self.adaptive.baseline_us(),
                "resync pace"
            );
        }
    }

    /// The adaptive pace, unless a static limit is set.
    fn adaptive_pace(&self) -> Option<Pace> {
        match self.resync_bytes_per_s {
            Some(l) if l > 0 => None,
            _ => Some(self.adaptive.pace()),
        }
    }

    /// When the next region may start: under the static limit, once the
    /// bytes begun so far, at the limit, take this long from the start;
    /// under the adaptive pace, once the last region's bytes took their
    /// time at its rate (or a tick later while it pauses).
    fn paced_until(&self, rs: &Resync) -> Option<Instant> {
        let now = Instant::now();
        let due = match self.adaptive_pace() {
            None => {
                let limit = self.resync_bytes_per_s.filter(|&l| l > 0)?;
                rs.started + Duration::from_secs_f64(rs.bytes_started as f64 / limit as f64)
            }
            Some(Pace::Free) => return None,
            Some(Pace::Pause) => now + self.cfg.tick,
            Some(Pace::Limit(_)) => rs.next_due?,
        };
        (due > now).then_some(due)
    }

    /// Regions copied at once: [`COPY_REGIONS_IN_FLIGHT`], except while
    /// the adaptive pace holds the copy back for clients: one then, so
    /// that the copy's bytes come as a trickle rather than in bursts
    /// (measured: four at once under the adaptive pace left the clients'
    /// 4K read p99 at 2x its value without a rebuild, one at once at
    /// 1x; bench/RESULTS.md, 2026-12-03, parallel region copies).
    fn copies_at_once(&self) -> usize {
        match self.adaptive_pace() {
            Some(Pace::Limit(_) | Pace::Pause) => 1,
            _ => COPY_REGIONS_IN_FLIGHT,
        }
    }

    /// The pause the rate limit asked for is over.
    pub(super) fn copy_paced(&mut self, attempt: u64) -> Flow {
        if let Some(rs) = self
            .resync
            .as_mut()
            .filter(|rs| rs.attempt == attempt && rs.phase == ResyncPhase::Copying)
        {
            rs.pace_wait = false;
            self.copy_next();
        }
        Flow::Continue
    }

    /// Starts copying regions (each locked against client writes until
    /// its copy is queued) while fewer than [`COPY_REGIONS_IN_FLIGHT`]
    /// are and the pace allows; finishes once none is left.
    fn copy_next(&mut self) {
        loop {
            let cap = self.copies_at_once();
            let Some(rs) = &mut self.resync else { return };
            if rs.pace_wait || rs.in_flight.len() >= cap {
                return;
            }
            let attempt = rs.attempt;
            if let Some(at) = self.resync.as_ref().and_then(|rs| self.paced_until(rs)) {
                if let Some(rs) = &mut self.resync {
                    rs.pace_wait = true;
                }
                self.spawn_report(async move {
                    tokio::time::sleep_until(at.into()).await;
                    Internal::CopyPaced { attempt }
                });
                return;
            }
            let Some(rs) = &mut self.resync else { return };
            let size = self.size;
            let next = std::iter::from_fn(|| rs.regions.pop_front()).find(|r| r * REGION < size);
            let Some(region) = next else {
                if rs.in_flight.is_empty() {
                    self.copied_all();
                }
                return;
            };
            self.copy_region(region);
        }
    }

    /// Every region is copied: a copy a change added waits for the commit,
    /// another is recorded active.
    fn copied_all(&mut self) {
        let Some(rs) = &mut self.resync else { return };
        if self.replicas[rs.idx].layouts.added() {
            self.synced();
            return;
        }
        rs.phase = ResyncPhase::Finishing;
        self.record_active();
    }

    /// Has the directory record the resync's target active, under the
    /// current generation.
    fn record_active(&mut self) {
        let Some(rs) = &self.resync else { return };
        let attempt = rs.attempt;
        let component = self.replicas[rs.idx].component;
        let (volume, generation) = (self.volume, self.generation);
        let control = self.control.clone();
        self.spawn_report(async move {
            let result = control
                .set_component_state(volume, component, ComponentState::Active, generation)
                .await;
            Internal::ResyncDone {
                attempt,
                generation,
                result,
            }
        });
    }

    /// Locks `region` and reads it from the next in-sync copy in turn.
    fn copy_region(&mut self, region: u64) {
        let readers: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.is_data() && r.mode == Mode::InSync && r.peer.is_some()
            })
            .collect();
        let Some(rs) = &mut self.resync else { return };
        let Some(src) = readers
            .get(region as usize % readers.len().max(1))
            .copied()
            .or(rs.source)
        else {
            return;
        };
        let attempt = rs.attempt;
        let off = region * REGION;
        let len = REGION.min(self.size - off);
        rs.next_due = match self.adaptive.pace() {
            Pace::Limit(r) => Some(Instant::now() + Duration::from_secs_f64(len as f64 / r as f64)),
            _ => None,
        };
        rs.in_flight.insert(region);
        rs.bytes_started += len;
        debug_assert!(off.is_multiple_of(BLOCK_SIZE));
        self.locks.push((off, off + len));
        let read = self.read_region(src, off, len);
        self.spawn_report(async move {
            let result = read.await;
            Internal::CopyRead {
                attempt,
                region,
                source: src,
                result,
            }
        });
    }

    /// A region was read from the source: queue it to the target (ahead of
    /// any later write) and release the region's lock.
    pub(super) fn copy_read(
        &mut self,
        attempt: u64,
        region: u64,
        source: usize,
        result: Result<Bytes, RpcError>,
    ) -> Flow {
        let Some(rs) = self.resync.as_ref().filter(|rs| rs.attempt == attempt) else {
            return Flow::Continue;
        };
        let idx = rs.idx;
        let data = match result {
            Ok(d) => d,
            Err(e) => {
                self.fail(source, state_for(&e));
                // A source that stays in service (the last in-sync copy)
                // does not abort the attempt by failing: abort it here, so
                // that the region's lock is released.
                if self.is_current(attempt) {
                    self.abort_resync();
                }
                return Flow::Continue;
            }
        };
        let copied = data.len() as u64;
        let sent = self.copy_request(idx, region * REGION, data);
        // The copy is queued ahead of any later write: release the region.
        let at = region * REGION;
        self.locks.retain(|&(start, _)| start != at);
        self.unblock();
        let timeout = self.cfg.io_timeout;
        self.spawn_report(async move {
            let result = answer(sent, timeout).await.map(|_| copied);
            Internal::CopyWritten {
                attempt,
                region,
                result,
            }
        });
        Flow::Continue
    }

    /// Sends a region's data to the resync target: as zeroes (freeing
    /// space) when it is all zero.
    fn copy_request(
        &self,
        idx: usize,
        off: u64,
        data: Bytes,
    ) -> Option<Result<PendingReply, RpcError>> {
        let t = &self.replicas[idx];
        let p = t.peer.as_ref().filter(|_| t.mode == Mode::Resyncing)?;
        let (req, payload) = if data.iter().all(|&b| b == 0) {
            let zeroes = Request::WriteZeroes {
                component: t.component,
                generation: self.generation,
                offset: off,
                len: data.len() as u64,
                seq: 0,
            };
            (zeroes, Bytes::new())
        } else {
            let write = Request::Write {
                component: t.component,
                generation: self.generation,
                offset: off,
                seq: 0,
            };
            (write, data)
        };
        Some(p.send(&req, payload))
    }

    pub(super) fn copy_written(
        &mut self,
        attempt: u64,
        region: u64,
        result: Result<u64, RpcError>,
    ) -> Flow {
        let Some(idx) = self
            .resync
            .as_ref()
            .filter(|rs| rs.attempt == attempt)
            .map(|rs| rs.idx)
        else {
            return Flow::Continue;
        };
        match result {
            Ok(bytes) => {
                if let Some(rs) = &mut self.resync {
                    rs.in_flight.remove(&region);
                    rs.bytes_done += bytes;
                }
                self.copied_since_tick += bytes;
                self.copy_next();
            }
            Err(e) => self.fail(idx, state_for(&e)),
        }
        Flow::Continue
    }

    pub(super) fn resync_done(
        &mut self,
        attempt: u64,
        generation: Generation,
        result: Result<(), ControlError>,
    ) -> Flow {
        if result == Err(ControlError::Conflict) {
            // Refused under a generation this owner raised since (a
            // reconnection's): asked again under its own. Anyone else's:
            // deposed.
            if generation >= self.generation {
                return Flow::Stop;
            }
            if self.is_current(attempt) {
                self.record_active();
                return Flow::Continue;
            }
        }
        if self
            .abandoned
            .as_ref()
            .is_some_and(|a| a.attempt == attempt)
        {
            self.settle_abandoned();
            return Flow::Continue;
        }
        if !self.is_current(attempt) {
            return Flow::Continue;
        }
        let Some(rs) = self.resync.take() else {
            return Flow::Continue;
        };
        let idx = rs.idx;
        match result {
            Ok(()) if self.replicas[idx].mode == Mode::Resyncing => {
                tracing::info!(
                    volume = self.volume,
                    component = self.replicas[idx].component,
                    "resync complete"
                );
                self.replicas[idx].mode = Mode::InSync;
                self.replicas[idx].degraded = false;
                self.replicas[idx].out_since = None;
            }
            Ok(()) => {}
            Err(_) => self.fail(idx, ComponentState::Absent),
        }
        Flow::Continue
    }

    /// Every region was copied to a copy a change added: it stays out of
    /// the reads, and its directory state `Reconfiguring`, until the change
    /// is committed (`super::reconfig`).
    fn synced(&mut self) {
        let Some(rs) = self.resync.take() else { return };
        let r = &mut self.replicas[rs.idx];
        debug_assert_eq!(r.mode, Mode::Resyncing);
        tracing::info!(
            volume = self.volume,
            component = r.component,
            "added copy in sync; waiting for the commit"
        );
        r.mode = Mode::Synced;
        self.advance_change();
    }

    /// Gives the attempt up: the target is out again (failing, if it may
    /// still be recorded active), the region lock is released, and the next
    /// attempt waits a while.
    pub(super) fn abort_resync(&mut self) {
        if let Some(rs) = self.resync.take() {
            if rs.phase == ResyncPhase::Finishing {
                self.abandon(rs.attempt, rs.idx);
            }
            let r = &mut self.replicas[rs.idx];
            if r.mode == Mode::Resyncing {
                r.mode = Mode::Out;
                r.peer = None;
            }
            self.resync_backoff = if r.degraded {
                DEGRADED_RETRY_TICKS
            } else {
                RESYNC_RETRY_TICKS
            };
        }
        if !self.locks.is_empty() {
            self.locks.clear();
            self.unblock();
        }
    }

    /// Gives up a finishing attempt: its target stays failing until the
    /// request to record it active answers.
    fn abandon(&mut self, attempt: u64, idx: usize) {
        tracing::warn!(
            volume = self.volume,
            component = self.replicas[idx].component,
            "resync given up while recording the copy active"
        );
        let r = &mut self.replicas[idx];
        r.mode = Mode::Failing;
        r.peer = None;
        self.abandoned = Some(Abandoned {
            attempt,
            idx,
            state: ComponentState::Absent,
        });
    }

    /// The request to record an abandoned attempt's target active answered
    /// (whatever it said): record the target out of service now; `Marked`
    /// then releases the writes that skipped it.
    fn settle_abandoned(&mut self) {
        if let Some(a) = self.abandoned.take() {
            self.record(a.idx, a.state);
        }
    }
}
