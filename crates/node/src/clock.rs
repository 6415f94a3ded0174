//! The clock drift check: the read lease assumes that no node's clock
//! runs faster or slower than [`shoal_owner::lease::CLOCK_DRIFT_PPM`]
//! (intervals are measured on monotonic clocks, so only their rate
//! matters). The directory leader checks it at run time: every heartbeat
//! carries the sender's monotonic milliseconds, and over windows of
//! [`DRIFT_WINDOW_S`] the leader compares how far the sender's clock
//! advanced with how far its own did. A rate outside the bound is logged
//! as an error and shown in `/metrics` (`shoal_clock_rate_error_ppm`).

use shoal_model::NodeId;
use shoal_owner::lease::CLOCK_DRIFT_PPM;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// Length of one comparison window, in seconds: a heartbeat's transit
/// time varies by milliseconds, so over a minute the measure is good to
/// well under a tenth of the bound.
pub const DRIFT_WINDOW_S: u64 = 60;

/// This process's monotonic clock, in milliseconds since it first asked.
pub fn mono_ms() -> u64 {
    static BASE: OnceLock<Instant> = OnceLock::new();
    let base = BASE.get_or_init(Instant::now);
    u64::try_from(base.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// What the leader knows of each node's clock rate.
#[derive(Default)]
pub struct ClockRates {
    inner: Mutex<HashMap<NodeId, Window>>,
}

#[derive(Clone, Copy)]
struct Window {
    /// The window's first sample: the leader's instant and the node's
    /// milliseconds then.
    start: (Instant, u64),
    /// The rate error measured over the last complete window, in ppm
    /// (positive: the node's clock runs fast).
    last_ppm: Option<i64>,
}

impl ClockRates {
    /// A heartbeat from `node`, whose clock read `node_ms`, arrived at
    /// `now`. Returns the rate error in ppm when a window completed and it
    /// exceeds the bound.
    pub fn observe(&self, node: NodeId, now: Instant, node_ms: u64) -> Option<i64> {
        let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let w = m.entry(node).or_insert(Window {
            start: (now, node_ms),
            last_ppm: None,
        });
        let (t0, n0) = w.start;
        if node_ms < n0 {
            // The node restarted: its clock has a new origin.
            w.start = (now, node_ms);
            return None;
        }
        let leader_ms = now.saturating_duration_since(t0).as_millis() as i64;
        if leader_ms < (DRIFT_WINDOW_S * 1000) as i64 {
            return None;
        }
        let node_ms_elapsed = node_ms as i64 - n0 as i64;
        let ppm = (node_ms_elapsed - leader_ms) * 1_000_000 / leader_ms;
        *w = Window {
            start: (now, node_ms),
            last_ppm: Some(ppm),
        };
        (ppm.unsigned_abs() > CLOCK_DRIFT_PPM).then_some(ppm)
    }

    /// The node restarted (its clock's origin moved): start over.
    pub fn forget(&self, node: NodeId) {
        let mut m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        m.remove(&node);
    }

    /// The last measured rate error of every node, in ppm.
    pub fn rates(&self) -> Vec<(NodeId, i64)> {
        let m = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<_> = m
            .iter()
            .filter_map(|(n, w)| w.last_ppm.map(|p| (*n, p)))
            .collect();
        v.sort_unstable();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_clock_within_the_bound_passes_and_one_beyond_is_reported() {
        let r = ClockRates::default();
        let t0 = Instant::now();
        assert_eq!(r.observe(1, t0, 5_000), None);
        assert_eq!(r.observe(2, t0, 0), None);
        let t1 = t0 + Duration::from_secs(DRIFT_WINDOW_S);
        // Node 1 gained 60 ms in 60 s: 1000 ppm, within the bound.
        assert_eq!(r.observe(1, t1, 5_000 + 60_060), None);
        // Node 2 gained 1.2 s: 20000 ppm, twice the bound.
        assert_eq!(r.observe(2, t1, 61_200), Some(20_000));
        assert_eq!(r.rates(), vec![(1, 1_000), (2, 20_000)]);
        // A slow clock too.
        let t2 = t1 + Duration::from_secs(DRIFT_WINDOW_S);
        assert_eq!(r.observe(2, t2, 61_200 + 58_800), Some(-20_000));
        r.forget(2);
        assert_eq!(r.rates(), vec![(1, 1_000)]);
    }

    #[test]
    fn no_verdict_before_a_whole_window() {
        let r = ClockRates::default();
        let t0 = Instant::now();
        r.observe(1, t0, 0);
        // Wildly off, but over one second: heartbeat jitter, not a rate.
        assert_eq!(r.observe(1, t0 + Duration::from_secs(1), 3_000), None);
        assert!(r.rates().is_empty());
    }
}
