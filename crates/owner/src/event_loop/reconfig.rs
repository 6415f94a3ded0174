//! The owner's half of a reconfiguration (`docs/reconfiguration.md`).
//!
//! The loop adopts the change the directory records (from its view, or
//! from the volume it started with): the added components join the loop
//! in the new layout only, those the change drops leave the new layout.
//! Each added data copy is brought in sync by the resync machinery (it
//! receives every write from its revival on), ends [`Mode::Synced`], and
//! keeps its directory state `Reconfiguring`; an added witness needs only
//! to answer its pings. Once every added component is ready the loop
//! commits; the added copies are then in sync and the dropped ones
//! *retire*: never written to again, removed from their nodes by the
//! nodes' garbage collection once the directory no longer has them.
//!
//! A change whose added copy cannot be brought in (its host is down or
//! its device failed) is aborted: the added copies retire, and whatever
//! asked for the change (the rebuild, `super::rebuild`) asks again with a
//! new placement.
//!
//! The votes rule counts both layouts while the change lasts
//! (`super::votes`): that is what makes the commit a single directory
//! command with no pause of I/O.

use super::replica::{Layouts, Mode, Replica, ReplicaSet};
use super::{Flow, Internal, Loop, CONTROL_RETRY_MS};
use crate::{ChangeEnd, Control, ControlError, Event, Target};
use shoal_model::{ComponentRole, Generation, Reconfig, Volume};
use std::time::Duration;

/// Where the loop is with the change in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ChangePhase {
    /// Bringing the added components in.
    Syncing,
    /// The commit or the abort was proposed; its answer is awaited.
    Ending,
}

/// The change in progress, as the directory recorded it.
pub(super) struct Change {
    pub(super) record: Reconfig,
    pub(super) phase: ChangePhase,
}

impl<C: Control> Loop<C> {
    /// A view of the directory: adopts the change it records if this loop
    /// follows none. A change whose components this loop has retired is a
    /// view from before that change ended, and is ignored.
    pub(super) fn follow_change(&mut self, volume: &Volume, targets: &[Target]) {
        let Some(r) = &volume.reconfig else { return };
        if self.change.is_some() {
            return;
        }
        let ended = r
            .added
            .iter()
            .chain(&r.remove)
            .any(|id| self.retired_ids.contains(id));
        if !ended {
            self.adopt(r, volume, targets);
        }
    }

    /// Takes on change `r`: its added components join (not connected, out
    /// of service until the resync revives them), those it drops leave the
    /// new layout.
    pub(super) fn adopt(&mut self, r: &Reconfig, volume: &Volume, targets: &[Target]) {
        tracing::info!(volume = self.volume, reason = %r.reason, "following a reconfiguration");
        for id in &r.added {
            if self.live_index(*id).is_some() {
                continue;
            }
            let Some(t) = targets.iter().find(|t| t.component.id == *id) else {
                continue;
            };
            if self.replicas.len() == ReplicaSet::CAPACITY {
                // Slots of retired copies are not reused (late reports of
                // their tasks name them): a new owner starts afresh.
                tracing::warn!(
                    volume = self.volume,
                    "no slot left for an added component; the owner restarts"
                );
                let _ = self.tx.send(Event::Stop);
                return;
            }
            let mut added = Replica::from_target(t, volume);
            added.out_since = None;
            self.replicas.push(added);
        }
        for rep in &mut self.replicas {
            if !rep.layouts.retired() && r.remove.contains(&rep.component) {
                rep.layouts.new = false;
            }
        }
        self.change = Some(Change {
            record: r.clone(),
            phase: ChangePhase::Syncing,
        });
        self.rebuild.problem = None;
    }

    /// The index of component `id` among the replicas that have not
    /// retired.
    pub(super) fn live_index(&self, id: u64) -> Option<usize> {
        self.replicas
            .iter()
            .position(|r| r.component == id && !r.layouts.retired())
    }

    /// The replicas the change in progress added.
    fn added(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.replicas.len()).filter(|&i| self.replicas[i].layouts.added())
    }

    /// On a tick, and whenever an added copy is synced: commits once every
    /// added component is ready, aborts once one cannot be brought in.
    pub(super) fn advance_change(&mut self) {
        if self
            .change
            .as_ref()
            .is_none_or(|c| c.phase != ChangePhase::Syncing)
        {
            return;
        }
        let lost = self.added().any(|i| {
            let r = &self.replicas[i];
            matches!(r.mode, Mode::Out | Mode::Failing) && (!r.node_up || r.degraded)
        });
        let ready = self.added().all(|i| {
            let r = &self.replicas[i];
            match r.role {
                ComponentRole::Data => r.mode == Mode::Synced,
                ComponentRole::Witness => r.witness_ok,
                ComponentRole::Stripe { .. } => unreachable!("{}", super::NO_STRIPES),
            }
        });
        if lost {
            self.end_change(false);
        } else if ready {
            self.end_change(true);
        }
    }

    /// Proposes the commit (or the abort) of the change in progress,
    /// retrying while the directory has no leader; reports
    /// [`Internal::ChangeEnded`].
    pub(super) fn end_change(&mut self, commit: bool) {
        let Some(change) = &mut self.change else {
            return;
        };
        change.phase = ChangePhase::Ending;
        let end = ChangeEnd {
            added: change.record.added.clone(),
            remove: change.record.remove.clone(),
            commit,
        };
        tracing::info!(
            volume = self.volume,
            reason = %change.record.reason,
            "{} the reconfiguration",
            if commit { "committing" } else { "aborting" }
        );
        let control = self.control.clone();
        let (volume, generation) = (self.volume, self.generation);
        let tx = self.tx.clone();
        self.spawn_report(async move {
            let result = loop {
                let r = control.end_reconfig(volume, generation, end.clone()).await;
                match r {
                    Err(ControlError::Unavailable(e)) if !tx.is_closed() => {
                        tracing::warn!("cannot end the reconfiguration: {e}; retrying");
                        tokio::time::sleep(Duration::from_millis(CONTROL_RETRY_MS)).await;
                    }
                    other => break other,
                }
            };
            Internal::ChangeEnded {
                end,
                generation,
                result,
            }
        });
    }

    /// The directory answered a commit or an abort.
    pub(super) fn change_end_answered(
        &mut self,
        end: ChangeEnd,
        generation: Generation,
        result: Result<(), ControlError>,
    ) -> Flow {
        match result {
            Ok(()) => self.change_ended(&end),
            // A resync of this owner raised the generation meanwhile:
            // propose the same end again under the new one.
            Err(ControlError::Conflict) if generation < self.generation => {
                self.end_change(end.commit)
            }
            Err(ControlError::Conflict) => return Flow::Stop,
            Err(e) if end.commit => {
                // An added copy was recorded failed meanwhile.
                tracing::warn!(volume = self.volume, "commit refused: {e}; aborting");
                self.end_change(false);
            }
            Err(e) => {
                tracing::warn!(volume = self.volume, "abort refused: {e}");
                if let Some(c) = &mut self.change {
                    c.phase = ChangePhase::Syncing;
                }
            }
        }
        Flow::Continue
    }

    /// The change ended in the directory: the loop switches to the layout
    /// it left (the new one after a commit, the old one after an abort).
    fn change_ended(&mut self, end: &ChangeEnd) {
        if self.change.take().is_none() {
            return;
        }
        tracing::info!(
            volume = self.volume,
            "reconfiguration {}",
            if end.commit { "committed" } else { "aborted" }
        );
        for i in 0..self.replicas.len() {
            let r = &mut self.replicas[i];
            if r.layouts.retired() {
                continue;
            }
            let stays = if end.commit {
                r.layouts.new
            } else {
                r.layouts.old
            };
            if !stays {
                self.retire(i);
                continue;
            }
            r.layouts = Layouts::BOTH;
            if r.mode == Mode::Synced {
                r.mode = Mode::InSync;
                r.out_since = None;
            }
        }
        // Writes that skipped a copy that has left the volume need not wait
        // for its record any more.
        self.release_parked();
    }

    /// Replica `i` left the volume: out of service for good.
    fn retire(&mut self, i: usize) {
        if self
            .resync
            .as_ref()
            .is_some_and(|s| s.idx == i || s.source == Some(i))
        {
            self.abort_resync();
        }
        if self.abandoned.as_ref().is_some_and(|a| a.idx == i) {
            self.abandoned = None;
        }
        if self.routed.is_some_and(|r| r.idx == i) {
            self.withdraw_route();
        }
        let r = &mut self.replicas[i];
        r.mode = Mode::Out;
        r.peer = None;
        r.witness_ok = false;
        r.layouts = Layouts::RETIRED;
        r.out_since = None;
        self.retired_ids.insert(r.component);
    }
}
