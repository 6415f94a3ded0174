//! The gate between reads in flight and the reuse of freed segments.
//!
//! A read looks up where its blocks are under the state lock, then reads
//! them from the device after the lock is dropped (on its own thread or on
//! a ring the caller drives). Until it has, the segments those blocks are
//! in must not be written again. Each such read holds a [`GatePass`]
//! (taken under the state lock); making segments reusable (a checkpoint,
//! also under the state lock) waits until no pass is out. No new pass can
//! be taken meanwhile (the state lock is held), so the wait is bounded by
//! the reads already at the device.

use std::sync::{Arc, Condvar, Mutex};

#[derive(Default)]
pub(crate) struct ReuseGate {
    out: Mutex<usize>,
    none_out: Condvar,
}

/// A read in flight: freed segments are not reused while it lives. Owned,
/// so it can travel with a read that the caller finishes later.
pub(crate) struct GatePass(Arc<ReuseGate>);

impl ReuseGate {
    /// Called with the state lock held.
    pub(crate) fn pass(self: &Arc<Self>) -> GatePass {
        *self.out.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        GatePass(self.clone())
    }

    /// Called with the state lock held: returns once every pass is back.
    pub(crate) fn wait_clear(&self) {
        let mut n = self.out.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = self.none_out.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for GatePass {
    fn drop(&mut self) {
        let mut n = self.0.out.lock().unwrap_or_else(|e| e.into_inner());
        assert!(*n > 0, "reuse gate: more passes returned than given");
        *n -= 1;
        if *n == 0 {
            self.0.none_out.notify_all();
        }
    }
}
