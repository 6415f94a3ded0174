//! Tracked regions, for delta resync: while one copy of a volume is out of
//! service, the surviving copies remember durably which 1 MiB regions of
//! each component were written since, so a copy that returns is sent only
//! those (`docs/store-log-format.md`, "Tracked regions").
//!
//! A second set per component, next to the marks and independent of them,
//! kept the same way: every change is a log entry (track, track all,
//! untrack all) appended before whatever is appended after it, replay
//! applies them in order, and every checkpoint records each set. The
//! regions tracked one by one, over all components of the device, never
//! pass [`format::max_tracked`] (half of [`format::max_marks`]); a
//! component whose set would pass it is tracked whole instead
//! ([`Tracked::All`], which takes none of that count).

use super::format::{self, Entry};
use super::{Comp, LogStore, Need, Result, State};
use crate::StoreError;
use std::collections::{BTreeMap, BTreeSet};

/// The regions of a component written while another copy of its volume
/// was out of service (see `LogStore::track_regions`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tracked {
    /// Too many to keep one by one: treat every region as written.
    All,
    /// These regions (1 MiB, `format::REGION_BLOCKS` blocks each), ascending.
    Regions(Vec<u32>),
}

/// A component's tracked set in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum TrackSet {
    /// These regions (none: nothing tracked).
    Regions(BTreeSet<u32>),
    /// Every region.
    All,
}

impl Default for TrackSet {
    fn default() -> Self {
        TrackSet::Regions(BTreeSet::new())
    }
}

impl TrackSet {
    /// Regions kept one by one: what counts against `max_tracked`.
    pub(super) fn listed(&self) -> u64 {
        match self {
            TrackSet::Regions(r) => r.len() as u64,
            TrackSet::All => 0,
        }
    }

    fn is_empty(&self) -> bool {
        matches!(self, TrackSet::Regions(r) if r.is_empty())
    }

    /// The set as the store's callers (and checkpoints) see it.
    pub(super) fn to_tracked(&self) -> Tracked {
        match self {
            TrackSet::Regions(r) => Tracked::Regions(r.iter().copied().collect()),
            TrackSet::All => Tracked::All,
        }
    }

    /// Applies one log entry of the tracking kinds (others are ignored):
    /// the one rule for the live store and for replay.
    pub(super) fn apply(&mut self, e: &Entry) {
        match *e {
            Entry::Track { region, .. } => {
                if let (TrackSet::Regions(set), Ok(r)) = (&mut *self, u32::try_from(region)) {
                    set.insert(r);
                }
            }
            Entry::TrackAll { .. } => *self = TrackSet::All,
            Entry::UntrackAll { .. } => *self = TrackSet::default(),
            _ => {}
        }
    }
}

/// Regions tracked one by one by all of `comps`.
pub(super) fn listed_total(comps: &BTreeMap<u64, Comp>) -> u64 {
    comps.values().map(|c| c.tracked.listed()).sum()
}

/// Collapses the largest sets of `comps` to `All` until at most `max`
/// regions are tracked one by one. A log the store wrote never needs it
/// (every prefix of it keeps the bound); it keeps any other input from
/// making a checkpoint larger than its slot. Returns how many collapsed.
pub(super) fn enforce_bound(comps: &mut BTreeMap<u64, Comp>, max: u64) -> usize {
    let mut collapsed = 0;
    while listed_total(comps) > max {
        let Some(c) = comps.values_mut().max_by_key(|c| c.tracked.listed()) else {
            break;
        };
        c.tracked = TrackSet::All;
        collapsed += 1;
    }
    collapsed
}

impl LogStore {
    /// Adds `regions` to component `id`'s tracked set, logging each region
    /// newly tracked (appended to the log, so durable with the next sync
    /// and always before anything appended after this call, e.g. an
    /// unmark). Past the bound ([`format::max_tracked`] regions tracked
    /// one by one on the device) the set collapses to [`Tracked::All`]
    /// (one log entry). Already tracked regions and a set already `All`
    /// cost nothing. `NoSuchComponent` if absent; otherwise it fails only
    /// as every logged change can (`NoSpace` when not even the cleaner's
    /// reserve is left, `Io` once the store has stopped).
    pub fn track_regions(&self, id: u64, regions: &[u32]) -> Result<()> {
        self.fail_check()?;
        let mut st = self.lock_state();
        let c = st.comps.get(&id).ok_or(StoreError::NoSuchComponent(id))?;
        let TrackSet::Regions(have) = &c.tracked else {
            return Ok(());
        };
        let new: BTreeSet<u32> = regions
            .iter()
            .copied()
            .filter(|r| !have.contains(r))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        if listed_total(&st.comps) + new.len() as u64 > self.max_tracked() {
            return self.log_tracked(&mut st, id, vec![Entry::TrackAll { comp: id }]);
        }
        let entries = new
            .into_iter()
            .map(|r| Entry::Track {
                comp: id,
                region: r as u64,
            })
            .collect();
        self.log_tracked(&mut st, id, entries)
    }

    /// Collapses component `id`'s tracked set to [`Tracked::All`] (one log
    /// entry, none if it is `All` already). `NoSuchComponent` if absent.
    pub fn track_all(&self, id: u64) -> Result<()> {
        self.fail_check()?;
        let mut st = self.lock_state();
        let c = st.comps.get(&id).ok_or(StoreError::NoSuchComponent(id))?;
        if c.tracked == TrackSet::All {
            return Ok(());
        }
        self.log_tracked(&mut st, id, vec![Entry::TrackAll { comp: id }])
    }

    /// Empties component `id`'s tracked set (one log entry, whatever its
    /// size; a no-op without a log entry when it is already empty).
    /// Durable with the next sync: until then a crash may leave the
    /// regions tracked, which costs a needless copy of them, nothing
    /// else. `Ok(())` if the component is absent.
    pub fn untrack_all(&self, id: u64) -> Result<()> {
        self.fail_check()?;
        let mut st = self.lock_state();
        match st.comps.get(&id) {
            Some(c) if !c.tracked.is_empty() => {
                self.log_tracked(&mut st, id, vec![Entry::UntrackAll { comp: id }])
            }
            _ => Ok(()),
        }
    }

    /// Component `id`'s tracked set; `None` if no such component.
    pub fn tracked_regions(&self, id: u64) -> Option<Tracked> {
        let st = self.lock_state();
        st.comps.get(&id).map(|c| c.tracked.to_tracked())
    }

    /// Regions the device may track one by one.
    pub(super) fn max_tracked(&self) -> u64 {
        format::max_tracked(self.sb.nsegs, self.sb.seg_blocks, self.sb.max_components)
    }

    /// Logs the tracking entries `entries` of component `id` and applies
    /// each once it is appended.
    fn log_tracked(&self, st: &mut State, id: u64, entries: Vec<Entry>) -> Result<()> {
        // Entries only (no data): like marks, they may use the cleaner's
        // reserve, so tracking never cleans inline on a writer's thread.
        self.ensure_space(st, 0, entries.len() as u64, Need::Freeing)?;
        for e in entries {
            self.append(st, e, None)?;
            if let Some(c) = st.comps.get_mut(&id) {
                c.tracked.apply(&e);
            }
        }
        Ok(())
    }
}
