//! The rebuild of a lost stripe column (`docs/erasure-coding.md`, A
//! column out of service): a column out of service for the repair delay
//! is replaced through the reconfiguration primitive
//! (`docs/reconfiguration.md`). The loop asks the directory to begin the
//! rebuild; the directory places a new column at the same position and
//! records the change; the loop fills the new column with the lost one's
//! unit of every slot holding live blocks, recomputed from `k` others,
//! then commits, and only then puts the new column in service. Nothing is
//! written to the columns meanwhile (a stripe is written whole), so the
//! copy misses nothing. A change this loop cannot carry through (the new
//! column fails, the lost one came back) is aborted and asked again later.

use super::{Ev, Loop};
use crate::capacity::ColumnTarget;
use crate::status::ResyncStatus;
use crate::{ChangeEnd, Control, ControlError, View};
use shoal_model::{ComponentId, ComponentRole, Generation, Reconfig, VolumeId};
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long after a refused or failed rebuild the loop asks again, in
/// seconds: the cluster may have gained a fault domain or space meanwhile.
const REBUILD_RETRY_S: u64 = 10;
/// How long after a rebuild was begun the loop waits for the view that
/// records it before asking again, in seconds.
const BEGUN_WAIT_S: u64 = 5;
/// Interval of retries of a commit or abort while the directory cannot
/// decide, in milliseconds.
const END_RETRY_MS: u64 = 500;

type Answer<T> = Pin<Box<dyn Future<Output = Result<T, ControlError>> + Send>>;

/// What the tiered loop asks of the directory, for one volume.
pub(crate) trait ColumnControl: Send + Sync {
    fn begin_rebuild(&self, generation: Generation, column: ComponentId) -> Answer<()>;
    fn end_reconfig(&self, generation: Generation, end: ChangeEnd) -> Answer<()>;
    fn commit_growth(
        &self,
        generation: Generation,
        size: u64,
        map_log_at: Option<u64>,
    ) -> Answer<()>;
}

/// [`ColumnControl`] over the owner's [`Control`].
pub(crate) struct Directory<C> {
    pub(crate) control: Arc<C>,
    pub(crate) volume: VolumeId,
}

impl<C: Control> ColumnControl for Directory<C> {
    fn begin_rebuild(&self, generation: Generation, column: ComponentId) -> Answer<()> {
        let (control, volume) = (self.control.clone(), self.volume);
        Box::pin(async move {
            control
                .begin_rebuild(volume, generation, vec![column])
                .await
        })
    }

    fn end_reconfig(&self, generation: Generation, end: ChangeEnd) -> Answer<()> {
        let (control, volume) = (self.control.clone(), self.volume);
        Box::pin(async move { control.end_reconfig(volume, generation, end).await })
    }

    fn commit_growth(
        &self,
        generation: Generation,
        size: u64,
        map_log_at: Option<u64>,
    ) -> Answer<()> {
        let (control, volume) = (self.control.clone(), self.volume);
        Box::pin(async move {
            control
                .commit_growth(volume, generation, size, map_log_at)
                .await
        })
    }
}

/// Where the loop is with the rebuild of a column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Phase {
    Idle,
    /// A request to begin one is in flight.
    Asking,
    /// Filling the added column of `change` at `position`.
    Copying {
        position: usize,
        change: Change,
    },
    /// The commit (or the abort) of `change` was proposed.
    Ending {
        position: usize,
        change: Change,
    },
}

/// A column change the directory recorded: `added` in place of `removed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Change {
    added: ColumnTarget,
    removed: ComponentId,
}

/// The loop's state of column healing.
pub(super) struct Healing {
    control: Arc<dyn ColumnControl>,
    /// The volume's size, for a column rebuilt in place of a lost one.
    pub(super) volume_bytes: u64,
    repair_delay: Duration,
    /// The directory's last view of the volume.
    view: Option<View>,
    /// Since when each column out of service has been out.
    out_since: BTreeMap<usize, Instant>,
    pub(super) phase: Phase,
    /// No request to begin a rebuild before this.
    quiet_until: Option<Instant>,
    /// Why the last request to begin one was refused.
    problem: Option<String>,
    /// Bytes of the copy in progress written, and its start and size.
    copied: Arc<AtomicU64>,
    copy_started: Option<(Instant, u64)>,
}

impl Healing {
    pub(super) fn new(control: Arc<dyn ColumnControl>, view: &View) -> Healing {
        Healing {
            control,
            volume_bytes: view.volume.size,
            repair_delay: view.repair_delay,
            view: Some(view.clone()),
            out_since: BTreeMap::new(),
            phase: Phase::Idle,
            quiet_until: None,
            problem: None,
            copied: Arc::new(AtomicU64::new(0)),
            copy_started: None,
        }
    }

    /// The column being rebuilt, which must not be brought back.
    pub(super) fn replacing(&self) -> Option<usize> {
        match &self.phase {
            Phase::Copying { position, .. } | Phase::Ending { position, .. } => Some(*position),
            _ => None,
        }
    }

    /// Columns waiting for the repair delay, with the time left.
    pub(super) fn waiting(&self, targets: &[ColumnTarget]) -> Vec<(ComponentId, Duration)> {
        let now = Instant::now();
        self.out_since
            .iter()
            .filter(|(p, _)| self.replacing() != Some(**p))
            .filter_map(|(&p, &since)| {
                let left = (since + self.repair_delay).saturating_duration_since(now);
                Some((targets.get(p)?.component, left))
            })
            .collect()
    }

    /// Why a lost column cannot be rebuilt now, if a request was refused.
    pub(super) fn problem(&self) -> Option<String> {
        self.problem.clone()
    }

    /// The copy in progress.
    pub(super) fn copy(&self) -> Option<ResyncStatus> {
        let Phase::Copying { change, .. } = &self.phase else {
            return None;
        };
        let (start, total) = self.copy_started?;
        Some(ResyncStatus {
            component: change.added.component,
            added: true,
            bytes_total: total,
            bytes_done: self.copied.load(Ordering::Relaxed),
            elapsed: start.elapsed(),
        })
    }
}

impl Loop {
    /// A view of the directory: the repair delay, and a column change to
    /// carry out.
    pub(super) fn heal_view(&mut self, view: View) {
        self.heal.repair_delay = view.repair_delay;
        self.columns_down(&view);
        let change = view
            .volume
            .reconfig
            .as_ref()
            .and_then(|r| self.column_change(r, &view));
        self.heal.view = Some(view);
        if !matches!(self.heal.phase, Phase::Idle | Phase::Asking) {
            return;
        }
        if let Some((position, change)) = change {
            self.begin_copy(position, change);
        }
    }

    /// Takes out of service the columns whose node the directory holds
    /// down or whose device failed: an idle volume would not notice.
    fn columns_down(&mut self, view: &View) {
        for p in self.set.in_service() {
            let Ok(t) = self.set.target(p) else { continue };
            let down = view.targets.iter().any(|x| {
                x.component.id == t.component
                    && (!x.node_up || x.component.state == shoal_model::ComponentState::Degraded)
            });
            if down {
                tracing::warn!(position = p, "stripe column's node is down: out of service");
                self.set.set_out(p);
            }
        }
    }

    /// The column change `r` records, if it replaces one of this loop's
    /// columns: its position and the added column's target.
    fn column_change(&self, r: &Reconfig, view: &View) -> Option<(usize, Change)> {
        let added = view.targets.iter().find(|t| {
            r.added.contains(&t.component.id)
                && matches!(t.component.role, ComponentRole::Stripe { .. })
        })?;
        let position = match added.component.role {
            ComponentRole::Stripe { position } => usize::from(position),
            _ => return None,
        };
        let removed = self.set.target(position).ok()?.component;
        r.remove.contains(&removed).then(|| {
            let added = ColumnTarget {
                component: added.component.id,
                device: added.component.device,
                addr: added.addr.clone(),
            };
            (position, Change { added, removed })
        })
    }

    /// Starts filling the added column, unless the lost one came back
    /// meanwhile (then the change is aborted).
    fn begin_copy(&mut self, position: usize, change: Change) {
        if self.set.in_service().contains(&position) {
            tracing::info!(
                position,
                "the lost stripe column is back: its rebuild is aborted"
            );
            self.end_column_change(position, change, false);
            return;
        }
        let slots = self.view().slots_to_rebuild();
        tracing::info!(position, slots = slots.len(), "rebuilding a stripe column");
        self.heal.copied.store(0, Ordering::Relaxed);
        let total = slots.len() as u64 * crate::stripes::UNIT_BYTES;
        self.heal.copy_started = Some((Instant::now(), total));
        self.heal.phase = Phase::Copying {
            position,
            change: change.clone(),
        };
        let (set, tx, copied) = (self.set.clone(), self.tx.clone(), self.heal.copied.clone());
        let volume = (self.view().volume(), self.heal.volume_bytes);
        tokio::spawn(async move {
            let r = set
                .copy_column(position, &change.added, volume, &slots, &copied)
                .await;
            let _ = tx.send(Ev::ColumnCopied(Box::new(r)));
        });
    }

    /// The added column is filled (or could not be): commit, or abort.
    pub(super) fn column_copied(&mut self, r: Result<shoal_rpc::Peer, super::ColumnError>) -> bool {
        let Phase::Copying { position, change } = self.heal.phase.clone() else {
            return true;
        };
        match r {
            Ok(peer) => {
                self.copied_peer = Some(peer);
                self.end_column_change(position, change, true);
            }
            Err(super::ColumnError::Deposed { .. }) => return false,
            Err(e) => {
                tracing::warn!(position, error = %e, "stripe column not rebuilt: the change is aborted");
                self.end_column_change(position, change, false);
            }
        }
        true
    }

    /// Proposes the commit (or the abort) of `change`, retrying while
    /// the directory cannot decide.
    fn end_column_change(&mut self, position: usize, change: Change, commit: bool) {
        self.heal.phase = Phase::Ending {
            position,
            change: change.clone(),
        };
        let end = ChangeEnd {
            added: vec![change.added.component],
            remove: vec![change.removed],
            commit,
        };
        self.end_change(end, move |result| Ev::ColumnChangeEnded { commit, result });
    }

    /// Proposes `end` of the change in progress under the owner's
    /// current generation, again every [`END_RETRY_MS`] while the
    /// directory cannot decide, and hands the answer to the loop as
    /// `answered` makes it.
    pub(super) fn end_change(
        &self,
        end: ChangeEnd,
        answered: impl FnOnce(Result<(), ControlError>) -> Ev + Send + 'static,
    ) {
        self.propose(move |c, g| c.end_reconfig(g, end.clone()), answered);
    }

    /// Asks the directory what `ask` asks under the owner's current
    /// generation, again every [`END_RETRY_MS`] while it cannot decide
    /// and the loop runs, and hands the answer to the loop as `answered`
    /// makes it.
    pub(super) fn propose(
        &self,
        ask: impl Fn(&dyn ColumnControl, Generation) -> Answer<()> + Send + 'static,
        answered: impl FnOnce(Result<(), ControlError>) -> Ev + Send + 'static,
    ) {
        let (control, tx, leg) = (self.heal.control.clone(), self.tx.clone(), self.leg.clone());
        tokio::spawn(async move {
            let r = loop {
                match ask(control.as_ref(), leg.generation()).await {
                    Err(ControlError::Unavailable(_)) if !tx.is_closed() => {
                        tokio::time::sleep(Duration::from_millis(END_RETRY_MS)).await;
                    }
                    other => break other,
                }
            };
            let _ = tx.send(answered(r));
        });
    }

    /// The directory answered the commit or abort of the column change.
    pub(super) fn column_change_ended(
        &mut self,
        commit: bool,
        r: Result<(), ControlError>,
    ) -> bool {
        let Phase::Ending { position, change } = self.heal.phase.clone() else {
            return true;
        };
        self.heal.phase = Phase::Idle;
        self.heal.copy_started = None;
        let peer = self.copied_peer.take();
        match (r, peer) {
            (Ok(()), Some(peer)) if commit => {
                tracing::info!(position, "stripe column rebuilt and in service");
                self.set.replace(position, change.added, peer);
                self.heal.out_since.remove(&position);
                self.heal.problem = None;
            }
            (Ok(()), _) => {
                self.heal.quiet_until = Some(Instant::now() + Duration::from_secs(REBUILD_RETRY_S));
            }
            (Err(ControlError::Conflict), _) => return false,
            (Err(e), _) => {
                tracing::warn!(position, error = %e, "the column change did not end");
                self.heal.quiet_until = Some(Instant::now() + Duration::from_secs(REBUILD_RETRY_S));
            }
        }
        true
    }

    /// On a tick: notes since when each column is out, and asks for the
    /// rebuild of one out for the repair delay.
    pub(super) fn heal_tick(&mut self) {
        let now = Instant::now();
        let service = self.set.in_service();
        for p in 0..self.set.columns().width() {
            if service.contains(&p) {
                self.heal.out_since.remove(&p);
            } else {
                self.heal.out_since.entry(p).or_insert(now);
            }
        }
        let quiet = self.heal.quiet_until.is_some_and(|t| now < t);
        let changing = self
            .heal
            .view
            .as_ref()
            .is_none_or(|v| v.volume.reconfig.is_some());
        if self.heal.phase != Phase::Idle || quiet || changing {
            return;
        }
        let delay = self.heal.repair_delay;
        let Some(position) = self
            .heal
            .out_since
            .iter()
            .find(|(_, since)| now.duration_since(**since) >= delay)
            .map(|(p, _)| *p)
        else {
            return;
        };
        let Ok(lost) = self.set.target(position) else {
            return;
        };
        tracing::info!(
            position,
            component = lost.component,
            "asking to rebuild a lost stripe column"
        );
        self.heal.phase = Phase::Asking;
        let (control, tx, generation) = (
            self.heal.control.clone(),
            self.tx.clone(),
            self.leg.generation(),
        );
        tokio::spawn(async move {
            let r = control.begin_rebuild(generation, lost.component).await;
            let _ = tx.send(Ev::RebuildAsked(r));
        });
    }

    /// The directory answered a request to begin a rebuild: the change
    /// it began arrives with a view.
    pub(super) fn rebuild_asked(&mut self, r: Result<(), ControlError>) {
        if self.heal.phase == Phase::Asking {
            self.heal.phase = Phase::Idle;
        }
        let wait = match r {
            Ok(()) => {
                self.heal.problem = None;
                BEGUN_WAIT_S
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot rebuild a lost stripe column");
                self.heal.problem = Some(e.to_string());
                REBUILD_RETRY_S
            }
        };
        self.heal.quiet_until = Some(Instant::now() + Duration::from_secs(wait));
        // A view that came while asking may already record the change.
        if let Some(view) = self.heal.view.clone() {
            self.heal_view(view);
        }
    }
}
