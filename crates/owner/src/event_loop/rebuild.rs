//! Rebuilding lost components elsewhere: a copy whose host has been
//! unreachable for the repair delay, or whose device failed (at once),
//! and a witness that has not answered for the repair delay, are replaced
//! by a reconfiguration (`super::reconfig`) that adds a component on
//! another fault domain and drops the lost one. The owner asks; the
//! directory's side (`Control::begin_rebuild`) places the replacements.
//!
//! The repair delay counts from when this loop saw the component leave
//! service (or from the loop's start for one already out): a new owner
//! waits the whole delay again, which errs on the side of not moving data
//! for a host that is only rebooting.

use super::replica::{Mode, Replica};
use super::{Flow, Internal, Loop};
use crate::status::{HealingStatus, ResyncStatus};
use crate::{Control, ControlError};
use shoal_model::{ComponentRole, Generation};
use std::time::Instant;

/// Ticks between requests to rebuild after one that failed (a tick is
/// 200 ms by default: every 10 s); a refusal says why the volume cannot
/// be rebuilt now (no fault domain or space left), and the cluster may
/// change meanwhile.
const REBUILD_RETRY_TICKS: u32 = 50;

/// The rebuild's state in the loop.
#[derive(Debug, Default)]
pub(super) struct Rebuild {
    /// A request to begin one is in flight.
    pub(super) asking: bool,
    /// Ticks to wait before the next request.
    pub(super) backoff: u32,
    /// Why the last request was refused, until one is accepted.
    pub(super) problem: Option<String>,
}

impl<C: Control> Loop<C> {
    /// Whether `r` is lost for good, as of `now`: out of service with its
    /// device failed, or out (a witness: silent) with its host down for
    /// the repair delay.
    fn is_lost(&self, r: &Replica, now: Instant) -> bool {
        if r.layouts.retired() || !r.layouts.new {
            return false;
        }
        let out = match r.role {
            ComponentRole::Data => r.mode == Mode::Out,
            ComponentRole::Witness => !r.witness_ok,
            ComponentRole::Stripe { .. } => unreachable!("{}", super::NO_STRIPES),
        };
        let waited = r
            .out_since
            .is_some_and(|since| now.saturating_duration_since(since) >= self.repair_delay);
        out && (r.degraded || (!r.node_up && waited))
    }

    /// On a tick: asks for the rebuild of every lost component, unless a
    /// change is in progress or a request is.
    pub(super) fn consider_rebuild(&mut self) {
        if self.change.is_some() || self.rebuild.asking {
            return;
        }
        if self.rebuild.backoff > 0 {
            self.rebuild.backoff -= 1;
            return;
        }
        let now = Instant::now();
        let lost: Vec<u64> = self
            .replicas
            .iter()
            .filter(|r| self.is_lost(r, now))
            .map(|r| r.component)
            .collect();
        if lost.is_empty() {
            return;
        }
        tracing::info!(volume = self.volume, ?lost, "rebuilding lost components");
        self.rebuild.asking = true;
        let control = self.control.clone();
        let (volume, generation) = (self.volume, self.generation);
        self.spawn_report(async move {
            let result = control.begin_rebuild(volume, generation, lost).await;
            Internal::RebuildBegun { generation, result }
        });
    }

    /// The directory answered a request to rebuild: the change it began
    /// reaches the loop with the next view.
    pub(super) fn rebuild_begun(
        &mut self,
        generation: Generation,
        result: Result<(), ControlError>,
    ) -> Flow {
        self.rebuild.asking = false;
        match result {
            // A resync of this owner raised the generation meanwhile.
            Err(ControlError::Conflict) if generation < self.generation => {}
            Ok(()) => {
                self.rebuild.problem = None;
                // The begun change arrives with a view (within
                // milliseconds); do not ask twice meanwhile.
                self.rebuild.backoff = 5;
            }
            Err(ControlError::Conflict) => return Flow::Stop,
            Err(e) => {
                tracing::warn!(volume = self.volume, "cannot rebuild: {e}");
                self.rebuild.problem = Some(e.to_string());
                self.rebuild.backoff = REBUILD_RETRY_TICKS;
            }
        }
        Flow::Continue
    }
}

impl<C: Control> Loop<C> {
    /// Publishes what the loop does to heal the volume: the copy under
    /// way, the change in progress, the rebuilds waiting for the repair
    /// delay and why lost components cannot be rebuilt.
    pub(super) fn publish_status(&self) {
        let now = Instant::now();
        let resync = self.resync.as_ref().map(|rs| ResyncStatus {
            component: self.replicas[rs.idx].component,
            added: self.replicas[rs.idx].layouts.added(),
            bytes_total: rs.bytes_total,
            bytes_done: rs.bytes_done,
            elapsed: now.saturating_duration_since(rs.started),
        });
        let waiting = self
            .replicas
            .iter()
            .filter(|r| !r.layouts.retired() && r.layouts.new && !r.node_up && !r.degraded)
            .filter(|r| match r.role {
                ComponentRole::Data => r.mode == Mode::Out,
                ComponentRole::Witness => !r.witness_ok,
                ComponentRole::Stripe { .. } => unreachable!("{}", super::NO_STRIPES),
            })
            .filter_map(|r| {
                let since = r.out_since?;
                let left = self
                    .repair_delay
                    .saturating_sub(now.saturating_duration_since(since));
                Some((r.component, left))
            })
            .collect();
        let status = HealingStatus {
            resync,
            change: self.change.as_ref().map(|c| c.record.reason.clone()),
            waiting,
            cannot_rebuild: self.rebuild.problem.clone(),
            reconciling: self.reconcile.is_some(),
        };
        let mut g = self.status.lock().unwrap_or_else(|e| e.into_inner());
        *g = status;
    }
}
