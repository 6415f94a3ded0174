//! The gate between reads in flight and the reuse of freed segments.
//!
//! A read looks up where its blocks are under the state lock, then reads
//! them from the device after the lock is dropped (on its own thread or on
//! a ring the caller drives). Until it has, the segments those blocks are
//! in must not be written again. Each such read holds a [`GatePass`]
//! (taken under the state lock) that pins the segments it reads.
//!
//! A checkpoint that frees segments (under the state lock) never waits for
//! a pass: a pass may belong to a read whose completion only the caller's
//! thread can collect, and that thread may itself be waiting for the state
//! lock (a node's runtime with one worker drives its read ring and also
//! writes). A freed segment that is pinned is parked as `Draining` instead,
//! and becomes free once no pass pins it ([`LogStore::release_drained`],
//! run wherever free segments are counted). No new pass can pin a freed
//! segment: it holds no live block any more, so no lookup finds one there.
//!
//! [`LogStore::release_drained`]: super::LogStore::release_drained

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

pub(crate) struct ReuseGate {
    /// Passes out per segment.
    pins: Box<[AtomicU32]>,
}

/// A read in flight: the segments it reads are not reused while it lives.
/// Owned, so it can travel with a read that the caller finishes later.
pub(crate) struct GatePass {
    gate: Arc<ReuseGate>,
    /// Distinct segments pinned (usually one).
    segs: Vec<u32>,
}

impl ReuseGate {
    pub(crate) fn new(nsegs: u32) -> ReuseGate {
        ReuseGate {
            pins: (0..nsegs).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Pins `segs` (segment numbers, any order, repeats allowed). Called
    /// with the state lock held, so a checkpoint freeing segments (also
    /// under it) sees every pin taken before it.
    pub(crate) fn pass(self: &Arc<Self>, mut segs: Vec<u32>) -> GatePass {
        segs.sort_unstable();
        segs.dedup();
        for &s in &segs {
            self.pins[s as usize].fetch_add(1, Ordering::Relaxed);
        }
        GatePass {
            gate: self.clone(),
            segs,
        }
    }

    /// Whether a read in flight still reads segment `s`.
    pub(crate) fn pinned(&self, s: u32) -> bool {
        self.pins[s as usize].load(Ordering::Acquire) > 0
    }
}

impl Drop for GatePass {
    fn drop(&mut self) {
        for &s in &self.segs {
            // Release: the read's use of the segment happens before a
            // checkpoint that sees the pin gone reuses it.
            let was = self.gate.pins[s as usize].fetch_sub(1, Ordering::Release);
            assert!(was > 0, "reuse gate: segment {s} unpinned more than pinned");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_count_per_segment_and_drop_with_the_pass() {
        let g = Arc::new(ReuseGate::new(4));
        let a = g.pass(vec![2, 1, 2]);
        let b = g.pass(vec![2]);
        assert!(g.pinned(1) && g.pinned(2) && !g.pinned(0) && !g.pinned(3));
        drop(a);
        assert!(!g.pinned(1) && g.pinned(2));
        drop(b);
        assert!(!g.pinned(2));
    }
}
