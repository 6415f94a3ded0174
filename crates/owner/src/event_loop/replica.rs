//! What the loop knows of each copy of the volume ([`Replica`], its
//! [`Mode`]) and the fixed-size set of copies ([`ReplicaSet`]) that writes,
//! reads and parked acknowledgements carry without allocating.

use crate::Target;
use shoal_model::{Component, ComponentRole, ComponentState, Volume};
use shoal_rpc::Peer;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// Up to date: receives writes, serves reads.
    InSync,
    /// Receives writes, being copied to; serves no reads.
    Resyncing,
    /// Failed; waiting for the directory to record it absent (for a
    /// resync target given up while being recorded active, first for that
    /// request to answer). Writes that miss it wait too.
    Failing,
    /// Not written to.
    Out,
    /// Added by the reconfiguration in progress and copied in full:
    /// receives every write, serves no reads, and becomes in sync when the
    /// change is committed.
    Synced,
}

/// Which of the volume's layouts a replica belongs to
/// (`docs/reconfiguration.md`): without a change in progress both, one
/// added by the change the new one only, one it drops the old one only,
/// and one that left the volume (a change committed or aborted while this
/// loop ran) neither: it is *retired*, never written to again, and its
/// slot may take a later change's component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layouts {
    pub(super) old: bool,
    pub(super) new: bool,
}

impl Layouts {
    pub(super) const BOTH: Layouts = Layouts {
        old: true,
        new: true,
    };
    pub(super) const RETIRED: Layouts = Layouts {
        old: false,
        new: false,
    };

    /// Where component `c` of `volume` stands.
    pub(super) fn of(volume: &Volume, c: &Component) -> Layouts {
        Layouts {
            old: volume.in_old_layout(c),
            new: volume.in_new_layout(c),
        }
    }

    pub(super) fn retired(self) -> bool {
        self == Layouts::RETIRED
    }

    /// Added by the change in progress (the new layout only).
    pub(super) fn added(self) -> bool {
        self.new && !self.old
    }
}

pub(super) struct Replica {
    pub(super) role: ComponentRole,
    pub(super) component: u64,
    pub(super) node: u64,
    pub(super) votes: u32,
    pub(super) device: u64,
    pub(super) addr: String,
    pub(super) node_up: bool,
    pub(super) peer: Option<Arc<Peer>>,
    pub(super) mode: Mode,
    /// Witnesses only: answered the last ping under our generation.
    pub(super) witness_ok: bool,
    /// Witnesses only: a ping is in flight (it ends within the connect
    /// timeout and two I/O timeouts); the next waits for its report.
    pub(super) pinging: bool,
    /// A reconnection of this in-sync copy is under way.
    pub(super) reconnecting: bool,
    /// A probe of this in-sync copy, whose node the directory has down, is
    /// in flight (`Loop::probe_down`).
    pub(super) probing: bool,
    /// Its device reported an I/O error (the directory says `Degraded`):
    /// a resync is tried only every [`super::DEGRADED_RETRY_TICKS`], since
    /// its store refuses everything until the node reopens it.
    pub(super) degraded: bool,
    /// The layouts it belongs to.
    pub(super) layouts: Layouts,
    /// Since when it has been out of service, as this loop saw it: the
    /// repair delay counts from here (`super::rebuild`).
    pub(super) out_since: Option<Instant>,
}

impl Replica {
    /// A copy as the directory describes it: not connected, not written to.
    pub(super) fn from_target(t: &Target, volume: &Volume) -> Replica {
        Replica {
            role: t.component.role,
            component: t.component.id,
            node: t.component.node,
            votes: t.component.votes,
            device: t.component.device,
            addr: t.addr.clone(),
            node_up: t.node_up,
            peer: None,
            mode: Mode::Out,
            witness_ok: false,
            pinging: false,
            reconnecting: false,
            probing: false,
            degraded: t.component.state == ComponentState::Degraded,
            layouts: Layouts::of(volume, &t.component),
            out_since: Some(Instant::now()),
        }
    }

    /// A copy of the addressing fields, without connection or state, for a
    /// task that (re)activates the component.
    pub(super) fn detached(&self) -> Replica {
        Replica {
            role: self.role,
            component: self.component,
            node: self.node,
            votes: self.votes,
            device: self.device,
            addr: self.addr.clone(),
            node_up: self.node_up,
            peer: None,
            mode: Mode::Out,
            witness_ok: false,
            pinging: false,
            reconnecting: false,
            probing: false,
            degraded: self.degraded,
            layouts: self.layouts,
            out_since: self.out_since,
        }
    }

    pub(super) fn is_data(&self) -> bool {
        self.role == ComponentRole::Data
    }
}

/// A set of replica indices, as one machine word: a volume has a handful
/// of components (at most 4 copies and their witnesses), far below
/// [`ReplicaSet::CAPACITY`], which the loop checks when it starts.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ReplicaSet(u64);

impl ReplicaSet {
    /// Most replicas a loop can hold.
    pub(super) const CAPACITY: usize = 64;
    pub(super) const EMPTY: ReplicaSet = ReplicaSet(0);

    pub(super) fn one(i: usize) -> ReplicaSet {
        let mut s = ReplicaSet::EMPTY;
        s.insert(i);
        s
    }

    /// Every index below `n` (for the debug checks).
    #[cfg(any(debug_assertions, test))]
    pub(super) fn below(n: usize) -> ReplicaSet {
        debug_assert!(n <= Self::CAPACITY);
        if n >= Self::CAPACITY {
            ReplicaSet(u64::MAX)
        } else {
            ReplicaSet((1u64 << n) - 1)
        }
    }

    pub(super) fn insert(&mut self, i: usize) {
        assert!(i < Self::CAPACITY, "replica index {i} out of range");
        self.0 |= 1 << i;
    }

    pub(super) fn contains(self, i: usize) -> bool {
        i < Self::CAPACITY && self.0 & (1 << i) != 0
    }

    pub(super) fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    pub(super) fn is_empty(self) -> bool {
        self.0 == 0
    }

    #[cfg(any(debug_assertions, test))]
    pub(super) fn is_subset(self, of: ReplicaSet) -> bool {
        self.0 & !of.0 == 0
    }

    #[cfg(any(debug_assertions, test))]
    pub(super) fn intersects(self, other: ReplicaSet) -> bool {
        self.0 & other.0 != 0
    }

    /// The `k`-th smallest index, if there are more than `k`.
    pub(super) fn nth(self, k: usize) -> Option<usize> {
        self.iter().nth(k)
    }

    /// The indices, smallest first.
    pub(super) fn iter(self) -> impl Iterator<Item = usize> {
        let mut bits = self.0;
        std::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let i = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            Some(i)
        })
    }
}

impl FromIterator<usize> for ReplicaSet {
    fn from_iter<I: IntoIterator<Item = usize>>(it: I) -> Self {
        let mut s = ReplicaSet::EMPTY;
        for i in it {
            s.insert(i);
        }
        s
    }
}

impl std::fmt::Debug for ReplicaSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}
