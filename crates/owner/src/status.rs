//! What an owner reports of its volume's healing, for `shoal volume
//! show`, the API and the metrics: published by the loop on every tick
//! and after every step of a copy, read through any [`crate::Owner`]
//! handle.

use shoal_model::ComponentId;
use std::time::Duration;

/// The volume's healing as its owner sees it now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HealingStatus {
    /// The copy being brought up to date, if any.
    pub resync: Option<ResyncStatus>,
    /// Why the layout is changing (a change in progress), if it is.
    pub change: Option<String>,
    /// Components out of service whose rebuild waits for the repair
    /// delay, with the time left.
    pub waiting: Vec<(ComponentId, Duration)>,
    /// Why the lost components cannot be rebuilt now (no fault domain or
    /// space left), until a rebuild is begun.
    pub cannot_rebuild: Option<String>,
    /// Regions a dead owner left in flight are being reconciled: the
    /// copies may still differ there.
    pub reconciling: bool,
}

/// One copy being brought up to date.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResyncStatus {
    pub component: ComponentId,
    /// A component a change added (a rebuild, a new policy) rather than a
    /// copy of the layout coming back.
    pub added: bool,
    /// Bytes to copy in all (0 until the plan is known).
    pub bytes_total: u64,
    /// Bytes copied so far.
    pub bytes_done: u64,
    /// How long the copy has run.
    pub elapsed: Duration,
}

impl ResyncStatus {
    /// Bytes copied per second so far.
    pub fn rate_bytes_per_s(&self) -> u64 {
        let ms = self.elapsed.as_millis().max(1);
        (u128::from(self.bytes_done) * 1000 / ms) as u64
    }

    /// Time left at the rate so far (None before the first bytes).
    pub fn eta(&self) -> Option<Duration> {
        let rate = self.rate_bytes_per_s();
        if rate == 0 {
            return None;
        }
        let left = self.bytes_total.saturating_sub(self.bytes_done);
        Some(Duration::from_secs(left.div_ceil(rate)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_and_eta_follow_the_bytes_copied() {
        let mut s = ResyncStatus {
            component: 1,
            added: true,
            bytes_total: 100 << 20,
            bytes_done: 0,
            elapsed: Duration::from_secs(2),
        };
        assert_eq!(s.eta(), None);
        s.bytes_done = 20 << 20;
        assert_eq!(s.rate_bytes_per_s(), 10 << 20);
        assert_eq!(s.eta(), Some(Duration::from_secs(8)));
    }
}

/// The capacity leg of an erasure-coded volume as its owner sees it now
/// (`docs/erasure-coding.md`): published by the tiered loop after every
/// event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierStatus {
    /// Blocks held on the performance leg and not destaged yet.
    pub staged_blocks: u64,
    /// Stripe columns out of service (no stripe is written while one
    /// is: destage waits, reads of their blocks are rebuilt).
    pub columns_out: u64,
    /// Stripes written by this owner (destages, cleans and client writes
    /// straight to the capacity leg).
    pub stripes_written: u64,
    /// Of those, stripes of client writes straight to the capacity leg.
    pub direct_stripes: u64,
    /// Bytes of the volume holding data (as of the last tick).
    pub written_bytes: u64,
    /// Columns out of service whose rebuild waits for the repair delay,
    /// with the time left.
    pub waiting: Vec<(ComponentId, Duration)>,
    /// The column being filled in place of a lost one.
    pub copy: Option<ResyncStatus>,
    /// Why a lost column cannot be rebuilt now.
    pub cannot_rebuild: Option<String>,
}

impl HealingStatus {
    /// The performance leg's healing with the capacity leg's folded in:
    /// one status per volume.
    pub fn with_columns(mut self, t: &TierStatus) -> HealingStatus {
        self.waiting.extend(t.waiting.iter().copied());
        if self.resync.is_none() {
            self.resync = t.copy.clone();
        }
        if let (None, Some(c)) = (&self.change, &t.copy) {
            self.change = Some(format!("rebuild of stripe component {}", c.component));
        }
        if self.cannot_rebuild.is_none() {
            self.cannot_rebuild = t.cannot_rebuild.clone();
        }
        self
    }
}
