//! What must hold between events. [`Loop::apply`] checks it after every
//! event, whatever the event's outcome, so a broken rule is caught at the
//! event that broke it rather than at the wrong acknowledgement it leads to.
//!
//! Checks that cost O(1) or O(replicas) run in every build, as `assert!`:
//! a loop that breaks one would route reads or acknowledge writes from a
//! state it does not understand, and stopping the node is safer. Checks
//! that walk queues of I/O (in-flight writes, parked writes, held-back
//! writes) run in debug builds only.

use super::replica::{Mode, ReplicaSet};
use super::resync::ResyncPhase;
use super::{Flow, Loop};
use crate::Control;
use shoal_model::ComponentRole;
use std::sync::Arc;

impl<C: Control> Loop<C> {
    pub(super) fn check_invariants(&self, flow: Flow) {
        self.check_replicas();
        self.check_resync();
        self.check_writes();
        self.check_route(flow);
        self.check_lease(flow);
        #[cfg(debug_assertions)]
        self.check_queues();
    }

    /// Reads wait for the lease only while it does not hold: it becomes
    /// valid only in a renewal, which serves them (the next tick starts
    /// another round after one without a majority).
    fn check_lease(&self, flow: Flow) {
        if flow == Flow::Stop {
            return;
        }
        assert!(
            self.lease_waiting.is_empty() || !self.lease.holds(),
            "{} reads wait for a lease that holds",
            self.lease_waiting.len()
        );
    }

    /// Each copy's role, mode and connection agree; the votes add up; at
    /// most one copy is being resynced, and it is the resync's target.
    fn check_replicas(&self) {
        let n = self.replicas.len();
        assert!((1..=ReplicaSet::CAPACITY).contains(&n), "{n} replicas");
        let mut resyncing = 0;
        for (i, r) in self.replicas.iter().enumerate() {
            self.check_layouts(i);
            match r.role {
                ComponentRole::Witness => assert_eq!(r.mode, Mode::Out, "witness {i} in service"),
                ComponentRole::Data => {
                    assert!(!r.witness_ok, "data copy {i} counted as witness");
                    assert!(!r.pinging, "data copy {i} pinged as witness");
                }
                ComponentRole::Stripe { .. } => panic!("{}", super::NO_STRIPES),
            }
            match r.mode {
                Mode::Resyncing => {
                    resyncing += 1;
                    assert!(r.peer.is_some(), "resyncing copy {i} without a connection");
                    assert!(
                        self.resync.as_ref().is_some_and(|rs| rs.idx == i),
                        "copy {i} resyncing outside the resync"
                    );
                }
                Mode::Failing => assert!(r.peer.is_none(), "failing copy {i} still connected"),
                Mode::Synced => assert!(r.peer.is_some(), "synced copy {i} without a connection"),
                Mode::InSync | Mode::Out => {}
            }
        }
        assert!(resyncing <= 1, "{resyncing} copies resyncing at once");
    }

    /// Replica `i` belongs to the layouts the change in progress says: an
    /// added one (the new layout only) or a dropped one (the old only)
    /// only while a change lasts, and named by it; a retired one is out of
    /// service, unconnected, and remembered as retired; an in-sync copy is
    /// in the old layout (an added copy waits for the commit, `Synced`).
    fn check_layouts(&self, i: usize) {
        let r = &self.replicas[i];
        let l = r.layouts;
        if l.retired() {
            assert!(
                r.mode == Mode::Out && r.peer.is_none() && !r.witness_ok,
                "retired component {i} in service"
            );
            assert!(
                self.retired_ids.contains(&r.component),
                "retired component {i} not remembered"
            );
            return;
        }
        let change = self.change.as_ref().map(|c| &c.record);
        if l.added() {
            assert!(
                change.is_some_and(|c| c.added.contains(&r.component)),
                "component {i} added outside a change"
            );
        }
        if !l.new {
            assert!(
                change.is_some_and(|c| c.remove.contains(&r.component)),
                "component {i} dropped outside a change"
            );
        }
        assert!(
            r.mode != Mode::InSync || l.old,
            "copy {i} in sync outside the old layout"
        );
        assert!(
            r.mode != Mode::Synced || l.added(),
            "copy {i} synced but not added by a change"
        );
    }

    /// The resync's target and source are where its phase says; a region
    /// lock is held only by a copy step, and writes wait only on a lock; an
    /// abandoned finish's target is failing, and no attempt follows it yet.
    fn check_resync(&self) {
        self.check_abandoned();
        for &(start, end) in &self.locks {
            assert!(start < end && end <= self.size, "bad lock {start}..{end}");
            let copying = self
                .resync
                .as_ref()
                .is_some_and(|rs| rs.phase == ResyncPhase::Copying);
            let reconciling = self
                .reconcile
                .as_ref()
                .and_then(|rc| rc.current)
                .is_some_and(|r| r * crate::REGION == start);
            assert!(
                copying != reconciling,
                "region lock held by neither (or both) a resync copying and a reconcile step"
            );
        }
        let in_flight = self.resync.as_ref().map_or(0, |rs| rs.in_flight.len());
        assert!(
            self.locks.len() <= in_flight.max(1)
                && in_flight <= super::resync::COPY_REGIONS_IN_FLIGHT,
            "{} locks, {in_flight} regions in flight",
            self.locks.len()
        );
        for (k, a) in self.locks.iter().enumerate() {
            assert!(
                self.locks[k + 1..]
                    .iter()
                    .all(|b| !super::io::overlaps(*a, *b)),
                "overlapping region locks"
            );
        }
        if let Some(rc) = &self.reconcile {
            assert!(self.resync.is_none(), "resync while reconciling");
            assert!(
                self.replicas[rc.source].is_data(),
                "reconciling from a witness"
            );
            assert!(
                rc.current
                    .is_none_or(|r| rc.regions.contains(&r) && self.locks.len() == 1),
                "reconcile step without its region or lock"
            );
        }
        assert!(
            self.blocked.is_empty() || !self.locks.is_empty(),
            "writes held back without a lock"
        );
        let Some(rs) = &self.resync else { return };
        assert_eq!(rs.attempt, self.resync_attempts, "resync of an old attempt");
        let target = &self.replicas[rs.idx];
        assert!(target.is_data(), "resync of a witness");
        match rs.phase {
            ResyncPhase::Reclaiming | ResyncPhase::Reviving => {
                // One raise of the generation at a time: each expects the
                // one before it.
                assert!(
                    !self.reconnect_reclaim,
                    "a resync and a reconnection raising the generation at once"
                );
                assert_eq!(target.mode, Mode::Out, "target in service before revival");
                assert!(rs.source.is_none(), "source chosen before revival");
            }
            ResyncPhase::Planning | ResyncPhase::Copying | ResyncPhase::Finishing => {
                assert_eq!(target.mode, Mode::Resyncing, "revived target not resyncing");
                let source = rs.source.map(|s| (s, self.replicas[s].mode));
                assert!(
                    matches!(source, Some((s, Mode::InSync)) if s != rs.idx),
                    "resync source {source:?} not another in-sync copy"
                );
            }
        }
        assert!(
            rs.in_flight.is_empty() || rs.phase == ResyncPhase::Copying,
            "regions in flight outside the copy phase"
        );
        for &(start, _) in &self.locks {
            assert!(
                self.reconcile.is_some() || rs.in_flight.contains(&(start / crate::REGION)),
                "a resync lock on a region not in flight"
            );
        }
    }

    /// An abandoned finish's target is a failing data copy, and the
    /// abandoned attempt is the last one started.
    fn check_abandoned(&self) {
        let Some(a) = &self.abandoned else { return };
        assert!(
            self.resync.is_none(),
            "resync started while one is abandoned"
        );
        assert_eq!(a.attempt, self.resync_attempts, "abandoned an old attempt");
        let r = &self.replicas[a.idx];
        assert!(
            r.is_data() && r.mode == Mode::Failing,
            "abandoned finishing copy {} is not failing",
            a.idx
        );
    }

    /// Sequence numbers, barriers and the futures waiting for answers
    /// agree; parked writes wait on a copy being recorded.
    fn check_writes(&self) {
        assert_eq!(
            self.inflight.len(),
            self.writes.len(),
            "in-flight writes and their futures differ"
        );
        assert!(
            self.last_barrier <= self.next_seq,
            "barrier ahead of writes"
        );
        if let Some((&first, _)) = self.inflight.first_key_value() {
            assert!(first >= self.last_barrier, "barrier past write {first}");
        }
        if let Some((&last, _)) = self.inflight.last_key_value() {
            assert!(last < self.next_seq, "write {last} not yet numbered");
        }
        assert!(
            self.parked.is_empty() || self.replicas.iter().any(|r| r.mode == Mode::Failing),
            "writes parked with no copy being recorded"
        );
    }

    /// The read route names the local copy only while it is in sync, under
    /// the current generation and size, over its current connection; it
    /// is withdrawn when the loop stops.
    fn check_route(&self, flow: Flow) {
        let Some(routed) = self.routed else { return };
        assert_eq!(flow, Flow::Continue, "read route left to a stopped loop");
        let r = &self.replicas[routed.idx];
        assert!(
            r.is_data() && r.mode == Mode::InSync && r.node == self.cfg.node,
            "read route to copy {} which is not the local in-sync copy",
            routed.idx
        );
        let conn = r.peer.as_ref().map(|p| Arc::as_ptr(p) as usize);
        assert_eq!(conn, Some(routed.conn), "read route over an old connection");
        assert_eq!(
            routed.generation, self.generation,
            "read route under an old generation"
        );
        assert_eq!(routed.size, self.size, "read route with an old size");
    }

    /// Walks the queues: every in-flight write went to data copies only;
    /// every parked write waits on at least one failing copy, none that
    /// took it; every held-back write overlaps the lock; the shared route
    /// holds what the loop believes it holds.
    #[cfg(debug_assertions)]
    fn check_queues(&self) {
        let all = ReplicaSet::below(self.replicas.len());
        for (seq, sent) in &self.inflight {
            assert!(
                !sent.is_empty() && sent.is_subset(all),
                "write {seq} sent to {sent:?}"
            );
            assert!(
                sent.iter().all(|i| self.replicas[i].is_data()),
                "write {seq} sent to a witness"
            );
        }
        for p in &self.parked {
            assert!(
                p.waiting.is_subset(all) && p.ok.is_subset(all),
                "parked write names unknown copies"
            );
            assert!(
                !p.waiting.intersects(p.ok),
                "parked write waits on a copy that took it"
            );
            assert!(
                p.waiting
                    .iter()
                    .any(|i| self.replicas[i].mode == Mode::Failing),
                "parked write waits on no failing copy"
            );
        }
        assert!(
            self.blocked.iter().all(|(w, _)| self
                .locks
                .iter()
                .any(|&l| super::io::overlaps(l, w.range()))),
            "a write held back outside the locks"
        );
        let published = match self.route.read() {
            Ok(g) => g.is_some(),
            Err(e) => e.into_inner().is_some(),
        };
        assert_eq!(
            published,
            self.routed.is_some(),
            "shared read route differs"
        );
    }
}
