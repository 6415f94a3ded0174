//! The votes rule in the loop: a majority of the votes in the old layout
//! and in the new one (joint majorities while a reconfiguration is in
//! progress, `docs/reconfiguration.md`; one layout otherwise). Serving,
//! acknowledging a write and renewing the read lease all count this way,
//! as the directory's `Volume::quorum` does.

use super::replica::Replica;

/// Votes per layout.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Tally {
    pub(super) old: u32,
    pub(super) new: u32,
}

impl Tally {
    /// The votes `r` carries in each layout it belongs to.
    pub(super) fn of(r: &Replica) -> Tally {
        Tally {
            old: if r.layouts.old { r.votes } else { 0 },
            new: if r.layouts.new { r.votes } else { 0 },
        }
    }

    pub(super) fn add(&mut self, t: Tally) {
        self.old += t.old;
        self.new += t.new;
    }

    /// Whether these votes are more than half of `total` in both layouts.
    pub(super) fn majority_of(self, total: Tally) -> bool {
        2 * self.old > total.old && 2 * self.new > total.new
    }

    /// The votes of every replica.
    pub(super) fn total(replicas: &[Replica]) -> Tally {
        let mut t = Tally::default();
        for r in replicas {
            t.add(Tally::of(r));
        }
        t
    }

    /// The votes of the replicas `has` accepts.
    pub(super) fn counting<'a>(
        replicas: &'a [Replica],
        has: impl Fn(usize, &'a Replica) -> bool,
    ) -> Tally {
        let mut t = Tally::default();
        for (i, r) in replicas.iter().enumerate() {
            if has(i, r) {
                t.add(Tally::of(r));
            }
        }
        t
    }
}

/// Whether the replicas `has` accepts hold a majority in both layouts;
/// if not, what they hold, for the client's error.
pub(super) fn joint_majority<'a>(
    replicas: &'a [Replica],
    has: impl Fn(usize, &'a Replica) -> bool,
) -> Result<(), String> {
    let total = Tally::total(replicas);
    let got = Tally::counting(replicas, has);
    if got.majority_of(total) {
        return Ok(());
    }
    if total.old == total.new && got.old == got.new {
        Err(format!("only {} of {} votes reachable", got.old, total.old))
    } else {
        Err(format!(
            "only {} of {} votes of the old layout and {} of {} of the new one reachable",
            got.old, total.old, got.new, total.new
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::Tally;

    #[test]
    fn a_majority_must_hold_in_both_layouts() {
        let total = Tally { old: 3, new: 3 };
        assert!(Tally { old: 2, new: 2 }.majority_of(total));
        assert!(!Tally { old: 2, new: 1 }.majority_of(total));
        assert!(!Tally { old: 1, new: 2 }.majority_of(total));
        // Raising ftt=1 to ftt=2: 3 votes before, 5 after.
        let total = Tally { old: 3, new: 5 };
        assert!(!Tally { old: 3, new: 2 }.majority_of(total));
        assert!(Tally { old: 2, new: 3 }.majority_of(total));
    }
}
