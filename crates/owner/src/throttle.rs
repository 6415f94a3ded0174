//! A volume's IOPS limit, the way vSAN counts it: every read or write is
//! counted in units of [`IOPS_UNIT_BYTES`] (a 4 KiB I/O is one, a 64 KiB
//! I/O two), reads and writes together, for the whole volume. The owner
//! admits all of a volume's I/O, from every node and connection, so this
//! is the one place the limit is kept.
//!
//! The limit is a generic cell rate algorithm (GCRA): a theoretical arrival
//! time `tat` advances by each admitted I/O's cost at the limit's rate; an
//! I/O may start once `tat` is at most [`IOPS_BURST_MS`] ahead of now. I/O
//! over the limit waits for its turn; it is never failed. Owns no I/O and
//! no clock: callers pass `now`, so tests drive it with synthetic time.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Size of one counted I/O, in bytes (vSAN normalises to 32 KiB).
pub const IOPS_UNIT_BYTES: u64 = 32 << 10;

/// Burst allowance, in milliseconds of the limit's rate: an idle volume
/// may start this much I/O at once (50 I/Os at 500 IOPS), so a client's
/// first burst is not delayed, while over a second the rate holds within
/// a tenth of the limit.
pub const IOPS_BURST_MS: u64 = 100;

/// Units an I/O of `len` bytes counts for (at least one).
pub fn units(len: u64) -> u64 {
    len.div_ceil(IOPS_UNIT_BYTES).max(1)
}

#[derive(Debug)]
struct State {
    /// Units per second; 0: no limit.
    limit: u32,
    /// Theoretical arrival time: when the I/O admitted so far would have
    /// ended at exactly the limit's rate. None: idle since the last change.
    tat: Option<Instant>,
}

/// The IOPS limit of one owned volume and what it has held back.
#[derive(Debug)]
pub struct Throttle {
    /// The limit, readable without the lock: a volume without one takes
    /// no lock per I/O.
    limit: AtomicU32,
    state: Mutex<State>,
    /// I/Os that had to wait.
    throttled_ios: AtomicU64,
    /// Time those I/Os waited, summed, in microseconds.
    throttled_us: AtomicU64,
}

/// What a throttle has done, for `shoal volume show` and `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThrottleStats {
    /// The limit in force, in units per second; 0: none.
    pub iops_limit: u32,
    pub throttled_ios: u64,
    pub throttled_us: u64,
}

impl Throttle {
    pub fn new(iops_limit: u32) -> Throttle {
        Throttle {
            limit: AtomicU32::new(iops_limit),
            state: Mutex::new(State {
                limit: iops_limit,
                tat: None,
            }),
            throttled_ios: AtomicU64::new(0),
            throttled_us: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the limit (0: none). I/O admitted from now on follows the
    /// new rate at once; the debt of the old rate is forgotten, so raising
    /// a limit never leaves new I/O waiting on the old one's schedule.
    pub fn set_limit(&self, iops_limit: u32) {
        let mut st = self.lock();
        if st.limit != iops_limit {
            st.limit = iops_limit;
            st.tat = None;
            self.limit.store(iops_limit, Relaxed);
        }
    }

    /// Admits an I/O of `units` at `now`: None to start it at once, or the
    /// instant it may start.
    pub fn admit(&self, units: u64, now: Instant) -> Option<Instant> {
        if self.limit.load(Relaxed) == 0 || units == 0 {
            return None;
        }
        let mut st = self.lock();
        if st.limit == 0 || units == 0 {
            return None;
        }
        let per_unit_ns = 1_000_000_000 / u64::from(st.limit);
        let cost = Duration::from_nanos(per_unit_ns.saturating_mul(units));
        let tat = st.tat.map_or(now, |t| t.max(now));
        let burst = Duration::from_millis(IOPS_BURST_MS);
        let start = tat.checked_sub(burst).map_or(now, |s| s.max(now));
        st.tat = Some(tat + cost);
        drop(st);
        if start <= now {
            return None;
        }
        let wait = start - now;
        self.throttled_ios.fetch_add(1, Relaxed);
        self.throttled_us
            .fetch_add(wait.as_micros() as u64, Relaxed);
        Some(start)
    }

    pub fn stats(&self) -> ThrottleStats {
        ThrottleStats {
            iops_limit: self.lock().limit,
            throttled_ios: self.throttled_ios.load(Relaxed),
            throttled_us: self.throttled_us.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn units_are_32_kib_rounded_up() {
        assert_eq!(units(0), 1);
        assert_eq!(units(512), 1);
        assert_eq!(units(4096), 1);
        assert_eq!(units(32 << 10), 1);
        assert_eq!(units((32 << 10) + 1), 2);
        assert_eq!(units(64 << 10), 2);
        assert_eq!(units(1 << 20), 32);
    }

    #[test]
    fn no_limit_never_waits() {
        let t = Throttle::new(0);
        let now = Instant::now();
        for _ in 0..10_000 {
            assert_eq!(t.admit(32, now), None);
        }
        assert_eq!(t.stats().throttled_ios, 0);
    }

    /// A steady stream of I/O, each started as soon as admitted: over a
    /// second it gets the limit plus the burst, and waits are recorded.
    #[test]
    fn a_busy_client_gets_the_limit() {
        let t = Throttle::new(500);
        let t0 = Instant::now();
        let mut started = 0;
        let mut next = t0;
        // QD1 client that issues the next I/O when the last may start.
        while next < t0 + Duration::from_secs(10) {
            next = t.admit(1, next).unwrap_or(next);
            started += 1;
        }
        // 10 s at 500/s plus the burst of 50.
        assert!((5_000..=5_052).contains(&started), "{started}");
        let s = t.stats();
        assert!(s.throttled_ios > 4_900, "{s:?}");
        assert!(s.throttled_us > 0, "{s:?}");
    }

    #[test]
    fn large_ios_count_more() {
        let t = Throttle::new(500);
        let t0 = Instant::now();
        let mut next = t0;
        let mut ios = 0;
        while next < t0 + Duration::from_secs(10) {
            next = t.admit(units(64 << 10), next).unwrap_or(next);
            ios += 1;
        }
        assert!((2_500..=2_527).contains(&ios), "{ios}");
    }

    #[test]
    fn a_new_limit_applies_at_once() {
        let t = Throttle::new(1);
        let t0 = Instant::now();
        // Debt of many seconds at 1 IOPS.
        for _ in 0..100 {
            t.admit(1, t0);
        }
        assert!(t.admit(1, t0).is_some());
        t.set_limit(1000);
        assert_eq!(t.admit(1, t0), None, "the old debt is forgotten");
        t.set_limit(0);
        assert_eq!(t.admit(1000, t0), None);
        assert_eq!(t.stats().iops_limit, 0);
    }

    proptest! {
        /// Whatever the arrivals, the I/O started in any window of time is
        /// at most the limit's rate over that window plus the burst (and
        /// the cost of one I/O).
        #[test]
        fn never_more_than_the_limit_plus_the_burst(
            limit in 1u32..5_000,
            arrivals in proptest::collection::vec((0u64..20_000, 1u64..40), 1..400),
        ) {
            let t = Throttle::new(limit);
            let t0 = Instant::now();
            let mut at: Vec<(u64, Instant)> = Vec::new();
            let mut clock = 0u64;
            for (gap_us, u) in arrivals {
                clock += gap_us;
                let now = t0 + Duration::from_micros(clock);
                let start = t.admit(u, now).unwrap_or(now);
                prop_assert!(start >= now);
                at.push((u, start));
            }
            at.sort_by_key(|x| x.1);
            for i in 0..at.len() {
                let mut units_in = 0u64;
                for j in i..at.len() {
                    units_in += at[j].0;
                    let span = at[j].1 - at[i].1;
                    let allowed = span.as_secs_f64() * f64::from(limit)
                        + f64::from(limit) * IOPS_BURST_MS as f64 / 1000.0
                        + at[j].0 as f64 + 1.0;
                    prop_assert!(units_in as f64 <= allowed,
                        "{units_in} units in {span:?} at {limit}/s");
                }
            }
        }
    }
}
