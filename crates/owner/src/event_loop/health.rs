//! The copies' health: what a replica's error means, taking a failed copy
//! out of service and having the directory record it, and the tick's
//! housekeeping (barriers, witness pings, reconnecting in-sync copies that
//! lost their connection).

use super::activation::{activate, connect};
use super::replica::{Mode, ReplicaSet};
use super::{report, Flow, Internal, Loop, CONTROL_RETRY_MS};
use crate::{Control, ControlError, Event, OwnerError};
use bytes::Bytes;
use shoal_model::{ComponentRole, ComponentState, Generation};
use shoal_rpc::{Peer, PeerAuth, RemoteError, Request, RpcError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The state a copy that gave `e` is recorded in: degraded when its device
/// failed (it must be rebuilt), absent when it could not be reached.
pub(super) fn state_for(e: &RpcError) -> ComponentState {
    match e {
        RpcError::Remote(
            RemoteError::Io(_) | RemoteError::Checksum { .. } | RemoteError::NoSpace,
        ) => ComponentState::Degraded,
        _ => ComponentState::Absent,
    }
}

/// The client's answer for an error that is not the copy's fault: the
/// request was out of range, there is no space, or a newer owner fenced
/// the copy (this one is deposed).
pub(super) fn owner_error(e: &RpcError) -> Option<OwnerError> {
    match e {
        RpcError::Remote(RemoteError::OutOfRange) => Some(OwnerError::OutOfRange),
        RpcError::Remote(RemoteError::NoSpace) => Some(OwnerError::NoSpace),
        RpcError::Remote(RemoteError::StaleGeneration { .. }) => Some(OwnerError::Deposed),
        _ => None,
    }
}

/// Whether `e` says a newer owner fenced the replica.
pub(super) fn is_stale(e: &RpcError) -> bool {
    matches!(e, RpcError::Remote(RemoteError::StaleGeneration { .. }))
}

/// Has the directory record `component` in `state`, retrying while it has
/// no leader; `None` once the loop is gone.
async fn record_state<C: Control>(
    control: Arc<C>,
    loop_tx: mpsc::UnboundedSender<Event>,
    (volume, generation): (u64, Generation),
    (idx, component): (usize, u64),
    state: ComponentState,
) -> Option<Internal> {
    loop {
        match control
            .set_component_state(volume, component, state, generation)
            .await
        {
            Ok(()) => return Some(Internal::Marked { idx }),
            Err(ControlError::Conflict) => {
                return Some(Internal::RecordConflict {
                    idx,
                    state,
                    generation,
                })
            }
            // The directory no longer has the component (a change that
            // dropped or undid it ended): nothing can read from it.
            Err(ControlError::Refused(e)) => {
                tracing::info!("component {component} not recorded {state}: {e}");
                return Some(Internal::Marked { idx });
            }
            Err(ControlError::Unavailable(e)) => {
                tracing::warn!("cannot record component {component} {state}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(CONTROL_RETRY_MS)).await;
                if loop_tx.is_closed() {
                    return None;
                }
            }
        }
    }
}

/// Pings a witness (`flush` carries the loop's generation), connecting (and
/// creating its component) first if its connection is gone; the connection
/// used, for the next ping.
async fn ping_witness(
    peer: Option<Arc<Peer>>,
    addr: String,
    auth: PeerAuth,
    create: Request,
    flush: Request,
    timeout: Duration,
) -> Result<Arc<Peer>, RpcError> {
    let peer = match peer {
        Some(p) if !p.is_closed() => p,
        _ => {
            let p = connect(&addr, &auth).await?;
            let _ = p.call(&create, Bytes::new(), timeout).await;
            p
        }
    };
    peer.call(&flush, Bytes::new(), timeout).await?;
    Ok(peer)
}

impl<C: Control> Loop<C> {
    /// Takes a replica out of service and has the directory record it
    /// absent (or degraded). Writes that skipped it wait for that record.
    pub(super) fn fail(&mut self, idx: usize, state: ComponentState) {
        if self.routed.is_some_and(|r| r.idx == idx) {
            // Before any write is acknowledged without this copy.
            self.withdraw_route();
        }
        let others_in_sync = self
            .replicas
            .iter()
            .enumerate()
            .any(|(i, r)| i != idx && r.mode == Mode::InSync);
        let r = &mut self.replicas[idx];
        if !matches!(r.mode, Mode::InSync | Mode::Resyncing | Mode::Synced) {
            return;
        }
        if r.mode == Mode::InSync && !others_in_sync {
            // The last up-to-date copy is never recorded absent: that would
            // leave no source to rebuild from. Keep it in sync, drop the
            // connection, and let the tick reconnect; I/O waits meanwhile.
            tracing::warn!(
                volume = self.volume,
                component = r.component,
                "last in-sync copy unreachable; reconnecting"
            );
            r.peer = None;
            return;
        }
        tracing::warn!(volume = self.volume, component = r.component, %state, "replica failed");
        if self.reconcile.as_ref().is_some_and(|rc| rc.source == idx) {
            // Reads of regions not yet reconciled have no source left: a
            // new owner reconciles afresh (`super::reconcile`).
            let _ = self.tx.send(Event::Stop);
        }
        r.mode = Mode::Failing;
        r.degraded |= state == ComponentState::Degraded;
        r.peer = None;
        r.out_since.get_or_insert_with(Instant::now);
        if self
            .resync
            .as_ref()
            .is_some_and(|s| s.idx == idx || s.source == Some(idx))
        {
            self.abort_resync();
        }
        self.record_failed(idx, state);
    }

    /// Has the directory record failed replica `idx` in `state`; for the
    /// target of an abandoned finish, only once the request to record it
    /// active answered, so that the two never land out of order.
    fn record_failed(&mut self, idx: usize, state: ComponentState) {
        match &mut self.abandoned {
            Some(a) if a.idx == idx => a.state = state,
            _ => self.record(idx, state),
        }
    }

    /// Has the directory record replica `idx` in `state`; reports
    /// [`Internal::Marked`] once it did.
    pub(super) fn record(&self, idx: usize, state: ComponentState) {
        let work = record_state(
            self.control.clone(),
            self.tx.clone(),
            (self.volume, self.generation),
            (idx, self.replicas[idx].component),
            state,
        );
        let tx = self.tx.clone();
        tokio::spawn(async move {
            if let Some(ev) = work.await {
                report(&tx, ev);
            }
        });
    }

    /// A record of replica `idx` was refused under `generation`: made
    /// again under the generation this owner raised since, or the owner
    /// is deposed.
    pub(super) fn record_conflict(
        &mut self,
        idx: usize,
        state: ComponentState,
        generation: Generation,
    ) -> Flow {
        if generation >= self.generation {
            return Flow::Stop;
        }
        self.record(idx, state);
        Flow::Continue
    }

    /// The directory recorded replica `idx` out of service: the writes
    /// that waited for it may be acknowledged.
    pub(super) fn marked(&mut self, idx: usize) -> Flow {
        if self.replicas[idx].mode == Mode::Failing {
            self.replicas[idx].mode = Mode::Out;
        }
        self.release_parked();
        Flow::Continue
    }

    pub(super) fn tick(&mut self) -> Flow {
        self.send_barrier();
        self.renew();
        self.expire_waiting_reads();
        self.expire_parked();
        self.ping_witnesses();
        self.reconnect_lost();
        self.probe_down();
        self.feed_pace();
        self.consider_resync();
        self.advance_change();
        self.consider_rebuild();
        self.publish_status();
        Flow::Continue
    }

    /// Barrier: every write older than the oldest in flight is complete,
    /// and the copies may forget their regions.
    fn send_barrier(&mut self) {
        if self.reconcile.is_some() {
            // It would clear the marks of a dead owner's writes not yet
            // reconciled (`super::reconcile`).
            return;
        }
        if self.replicas.iter().any(|r| r.mode == Mode::Failing) {
            // A write that missed a copy not yet recorded out must stay
            // dirty on the others: should this owner die before the
            // record, the next one finds that copy active and reconciles
            // only what is dirty.
            return;
        }
        let upto = self
            .inflight
            .first_key_value()
            .map_or(self.next_seq, |(&seq, _)| seq);
        let moved =
            upto > self.last_barrier + 1 || (upto > self.last_barrier && self.inflight.is_empty());
        // Once every copy is in sync again, one barrier (a repeat if need
        // be) empties the tracked sets, writes or not.
        let track = self.tracking();
        if !moved && track == self.last_track {
            return;
        }
        self.last_barrier = upto;
        self.last_track = track;
        for i in self.targets().iter() {
            let r = &self.replicas[i];
            if let Some(p) = &r.peer {
                let _ = p.send(
                    &Request::Barrier {
                        component: r.component,
                        generation: self.generation,
                        seq: upto,
                        track,
                    },
                    Bytes::new(),
                );
            }
        }
    }

    /// Witness pings, at most one in flight per witness, so that pings do
    /// not pile up against a witness that hangs.
    fn ping_witnesses(&mut self) {
        let due: ReplicaSet = (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.role == ComponentRole::Witness && r.node_up && !r.pinging && !r.layouts.retired()
            })
            .collect();
        for idx in due.iter() {
            self.replicas[idx].pinging = true;
            self.ping(idx);
        }
    }

    /// Pings witness `idx`; reports [`Internal::WitnessPing`].
    fn ping(&self, idx: usize) {
        let r = &self.replicas[idx];
        let create = Request::CreateComponent {
            component: r.component,
            volume: self.volume,
            device: r.device,
            size: 0,
        };
        let flush = Request::Flush {
            component: r.component,
            generation: self.generation,
        };
        let ping = ping_witness(
            r.peer.clone(),
            r.addr.clone(),
            self.cfg.peer_auth.clone(),
            create,
            flush,
            self.cfg.io_timeout,
        );
        self.spawn_report(async move {
            let result = ping.await;
            Internal::WitnessPing { idx, result }
        });
    }

    /// A witness fenced by a newer owner deposes us; one that answered
    /// counts, and keeps the connection the ping used.
    pub(super) fn witness_pinged(
        &mut self,
        idx: usize,
        result: Result<Arc<Peer>, RpcError>,
    ) -> Flow {
        if result.as_ref().is_err_and(is_stale) {
            return Flow::Stop;
        }
        let r = &mut self.replicas[idx];
        r.pinging = false;
        if r.layouts.retired() {
            return Flow::Continue;
        }
        r.witness_ok = result.is_ok();
        r.peer = result.ok();
        if r.witness_ok {
            r.out_since = None;
        } else {
            r.out_since.get_or_insert_with(Instant::now);
        }
        Flow::Continue
    }

    /// Probes the in-sync copies whose node the directory has down, at
    /// most one probe each at a time: a volume without I/O would
    /// otherwise never find its copy gone (nothing fails), and never
    /// rebuild it. The directory's word alone takes no copy out of
    /// service (it may be this very node, just resumed); a probe that
    /// fails does, as a failed write would.
    fn probe_down(&mut self) {
        let due: ReplicaSet = (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.is_data() && r.mode == Mode::InSync && !r.node_up && !r.probing
            })
            .collect();
        for idx in due.iter() {
            let r = &mut self.replicas[idx];
            r.probing = true;
            let sent = r
                .peer
                .as_ref()
                .map(|p| p.send(&Request::Ping, Bytes::new()));
            let timeout = self.cfg.io_timeout;
            self.spawn_report(async move {
                let result = match sent {
                    Some(Ok(p)) => p.wait(timeout).await.map(|_| ()),
                    Some(Err(e)) => Err(e),
                    None => Err(RpcError::Closed),
                };
                Internal::Probed { idx, result }
            });
        }
    }

    pub(super) fn probed(&mut self, idx: usize, result: Result<(), RpcError>) -> Flow {
        self.replicas[idx].probing = false;
        match result {
            Err(e) if is_stale(&e) => return Flow::Stop,
            Err(e) if self.replicas[idx].mode == Mode::InSync => {
                tracing::warn!(
                    volume = self.volume,
                    component = self.replicas[idx].component,
                    "a copy whose node is down does not answer: {e}"
                );
                self.fail(idx, ComponentState::Absent);
            }
            Err(_) | Ok(()) => {}
        }
        Flow::Continue
    }

    /// In-sync copies that lost their connection and are not being
    /// reconnected.
    fn lost(&self) -> ReplicaSet {
        (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.mode == Mode::InSync && r.peer.is_none() && !r.reconnecting
            })
            .collect()
    }

    /// Reconnects in-sync copies that lost their connection, in three
    /// steps: a bare connection shows the copy reachable again (nothing
    /// is asked of the directory while it is not); the generation is
    /// raised and the copies in service take it; only then is the copy
    /// activated, under the new generation. A frame of the lost session
    /// still queued at the copy can then never land after a newer write:
    /// the copy refuses the older generation once it took the new one.
    fn reconnect_lost(&mut self) {
        if self.reconnect_reclaim {
            return;
        }
        let auth = self.cfg.peer_auth.clone();
        for idx in self.lost().iter() {
            let r = &mut self.replicas[idx];
            r.reconnecting = true;
            let (addr, auth) = (r.addr.clone(), auth.clone());
            self.spawn_report(async move {
                let result = connect(&addr, &auth).await.map(|_| ());
                Internal::LostReached { idx, result }
            });
        }
    }

    /// A lost copy's node answered a connection (or not): raise the
    /// generation to reconnect it, unless another raise or a record made
    /// under the current generation is under way (then the next tick).
    pub(super) fn lost_reached(&mut self, idx: usize, result: Result<(), RpcError>) -> Flow {
        let r = &mut self.replicas[idx];
        if let Err(e) = result {
            tracing::debug!(
                volume = self.volume,
                component = r.component,
                "still lost: {e}"
            );
            r.reconnecting = false;
            return Flow::Continue;
        }
        if self.reconnect_reclaim || !self.may_raise_generation() {
            self.replicas[idx].reconnecting = false;
            return Flow::Continue;
        }
        self.reconnect_reclaim = true;
        let control = self.control.clone();
        let (volume, generation) = (self.volume, self.generation);
        self.spawn_report(async move {
            let result = control.reclaim(volume, generation).await;
            Internal::ReconnectReclaimed { result }
        });
        Flow::Continue
    }

    /// Whether nothing in flight depends on the current generation staying
    /// current: no record of a failed copy, no resync raising or using a
    /// raised one. (The directory takes such a record only under the
    /// generation it was made under.)
    fn may_raise_generation(&self) -> bool {
        use super::resync::ResyncPhase;
        let resync_raising = self.resync.as_ref().is_some_and(|rs| {
            matches!(
                rs.phase,
                ResyncPhase::Reclaiming | ResyncPhase::Reviving | ResyncPhase::Finishing
            )
        });
        !resync_raising
            && self.abandoned.is_none()
            && self.replicas.iter().all(|r| r.mode != Mode::Failing)
    }

    /// The generation was raised for a reconnection: the copies in service
    /// take it, then every lost copy is activated under it.
    pub(super) fn reconnect_reclaimed(&mut self, result: Result<Generation, ControlError>) -> Flow {
        self.reconnect_reclaim = false;
        let lost: ReplicaSet = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].mode == Mode::InSync && self.replicas[i].peer.is_none())
            .collect();
        // A copy that left service meanwhile is reconnected no more (its
        // mark would otherwise keep it from every later reconnection).
        for (i, r) in self.replicas.iter_mut().enumerate() {
            if r.reconnecting && !lost.contains(i) {
                r.reconnecting = false;
            }
        }
        match result {
            Ok(g) => {
                self.set_generation(g);
                self.fence_in_service();
                for idx in lost.iter() {
                    self.activate_lost(idx);
                }
            }
            Err(ControlError::Conflict) => return Flow::Stop,
            Err(e @ (ControlError::Unavailable(_) | ControlError::Refused(_))) => {
                tracing::warn!(
                    volume = self.volume,
                    "cannot raise the generation to reconnect: {e}"
                );
                for idx in lost.iter() {
                    self.replicas[idx].reconnecting = false;
                }
            }
        }
        Flow::Continue
    }

    /// Activates lost copy `idx` under the current generation.
    fn activate_lost(&mut self, idx: usize) {
        let r = &mut self.replicas[idx];
        r.reconnecting = true;
        let tmp = r.detached();
        let (volume, size, generation, timeout) =
            (self.volume, self.size, self.generation, self.cfg.io_timeout);
        let auth = self.cfg.peer_auth.clone();
        self.spawn_report(async move {
            let peer = activate(&tmp, &auth, volume, size, generation, timeout)
                .await
                .map(|a| a.peer);
            Internal::Reconnected { idx, peer }
        });
    }

    pub(super) fn reconnected(&mut self, idx: usize, peer: Result<Arc<Peer>, RpcError>) -> Flow {
        let r = &mut self.replicas[idx];
        r.reconnecting = false;
        match peer {
            Ok(p) if r.mode == Mode::InSync && r.peer.is_none() => {
                tracing::info!(volume = self.volume, component = r.component, "reconnected");
                r.peer = Some(p);
                Flow::Continue
            }
            Ok(_) => Flow::Continue,
            // The copy took a newer owner's generation: this one is deposed.
            Err(e) if is_stale(&e) => Flow::Stop,
            Err(e) => {
                tracing::debug!(volume = self.volume, "reconnect failed: {e}");
                Flow::Continue
            }
        }
    }
}
