//! The read lease: an owner serves reads only while a quorum of the
//! volume's votes has recently confirmed it, and a newer owner serves
//! nothing before any lease of an older one must have ended. Both halves
//! of the protocol live here: [`Lease`], the owner's deadline (shared with
//! its handles, which check it on the read path around the loop), and
//! [`Grants`], what a replica remembers of the leases it granted.
//!
//! Why it is safe (`docs/lease.md` has the whole argument): a lease renewed
//! by a round sent at time S ends, on the owner's clock, at S + L. Every
//! replica that confirmed it received the round after S, and refuses the
//! old generation once a newer owner activated it. A newer owner activates
//! copies with more than half of the votes, so at least one of them
//! confirmed the old owner's last successful round; each activated replica
//! reports how long the lease it last granted may still run on anyone's
//! clock (its own measure, stretched by the clock drift bound), and the
//! new owner waits for the longest report before it serves anything.
//!
//! Owns: timing only. Must never touch data or generations.

use shoal_model::{ComponentId, Generation};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one renewal keeps an owner's lease, in milliseconds: ten
/// renewal rounds (one per tick of 200 ms) fit in it, so a slow round or
/// two never interrupts reads; short enough that an owner cut off from its
/// copies stops serving reads well within the failover time (a node is
/// declared down after 3 s of silence, and a newer owner waits for what
/// is left of the lease, usually nothing by then).
pub const LEASE_MS: u32 = 2_000;

/// The stated bound on how far any node's clock may run fast or slow, in
/// parts per million of elapsed time (1%): a hundred times what quartz
/// clocks drift, and twice what NTP may slew. Intervals are measured on
/// monotonic clocks, so only the rate matters, never the time of day.
/// Checked at run time from the nodes' heartbeats (`shoal_node::liveness`).
pub const CLOCK_DRIFT_PPM: u64 = 10_000;

/// `ms` measured on one clock, stretched so that it covers the same span
/// measured on any other clock within [`CLOCK_DRIFT_PPM`]: one clock may
/// run slow by the bound and the other fast, so the span grows by
/// (1 + e) / (1 - e), rounded up.
pub fn with_drift_margin(ms: u32) -> u32 {
    let e = CLOCK_DRIFT_PPM;
    let num = u64::from(ms) * (1_000_000 + e);
    let den = 1_000_000 - e;
    u32::try_from(num.div_ceil(den)).unwrap_or(u32::MAX)
}

/// An owner's lease: the instant until which it may serve reads. Shared
/// between the loop (which extends it after each successful renewal) and
/// the owner's handles (which check it before a read around the loop).
#[derive(Debug)]
pub struct Lease {
    base: Instant,
    /// Nanoseconds after `base` until which the lease holds; 0: none.
    until_ns: AtomicU64,
}

impl Default for Lease {
    fn default() -> Self {
        Lease {
            base: Instant::now(),
            until_ns: AtomicU64::new(0),
        }
    }
}

impl Lease {
    fn ns(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Whether the lease holds at `now`.
    pub fn holds_at(&self, now: Instant) -> bool {
        self.ns(now) < self.until_ns.load(Ordering::Acquire)
    }

    /// Whether the lease holds now.
    pub fn holds(&self) -> bool {
        self.holds_at(Instant::now())
    }

    /// A round sent at `sent` was confirmed by a quorum: the lease holds
    /// until `sent` + [`LEASE_MS`] (never shortened by an older round
    /// answering late).
    pub fn renewed(&self, sent: Instant) {
        let until = sent + Duration::from_millis(u64::from(LEASE_MS));
        self.until_ns.fetch_max(self.ns(until), Ordering::AcqRel);
    }

    /// The lease ends now (the owner stops).
    pub fn end(&self) {
        self.until_ns.store(0, Ordering::Release);
    }

    /// When the lease ends, if it holds.
    pub fn until(&self) -> Option<Instant> {
        match self.until_ns.load(Ordering::Acquire) {
            0 => None,
            ns => Some(self.base + Duration::from_nanos(ns)),
        }
    }
}

/// One lease a replica granted: to which generation, when (on the
/// replica's clock), for how long.
#[derive(Debug, Clone, Copy)]
struct Grant {
    generation: Generation,
    at: Instant,
    lease_ms: u32,
}

impl Grant {
    /// Milliseconds from `now` until the lease may have ended on any
    /// clock within the drift bound.
    fn left_ms(&self, now: Instant) -> u32 {
        let end = self.at + Duration::from_millis(u64::from(with_drift_margin(self.lease_ms)));
        u32::try_from(end.saturating_duration_since(now).as_millis()).unwrap_or(u32::MAX)
    }
}

/// The leases a replica granted, per component, in memory. A replica that
/// restarted may have granted a lease of up to
/// [`shoal_rpc::MAX_LEASE_MS`] just before it stopped: until it grants
/// one itself, a component is taken to hold such a lease from the
/// process's start.
#[derive(Debug)]
pub struct Grants {
    started: Instant,
    map: Mutex<HashMap<ComponentId, Grant>>,
}

impl Grants {
    pub fn new(started: Instant) -> Grants {
        Grants {
            started,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// Records a lease of `lease_ms` granted at `now` to `generation` (the
    /// caller checked that it is the component's generation). Refused
    /// with the newer generation when one was activated since that check:
    /// a renewal that raced an activation must not be answered as granted
    /// after the activation reported what was left of the older leases.
    pub fn grant(
        &self,
        c: ComponentId,
        generation: Generation,
        lease_ms: u32,
        now: Instant,
    ) -> Result<(), Generation> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        Self::record(&mut map, c, generation, lease_ms, now)
    }

    fn record(
        map: &mut HashMap<ComponentId, Grant>,
        c: ComponentId,
        generation: Generation,
        lease_ms: u32,
        at: Instant,
    ) -> Result<(), Generation> {
        if let Some(g) = map.get(&c).filter(|g| g.generation > generation) {
            return Err(g.generation);
        }
        let grant = Grant {
            generation,
            at,
            lease_ms,
        };
        map.insert(c, grant);
        Ok(())
    }

    /// The component is activated under `generation` at `now`: returns how
    /// many milliseconds a lease granted to an older generation may still
    /// run, and records the activation as a lease granted to the new one
    /// (its owner counts the activation as its first renewal).
    pub fn activate(&self, c: ComponentId, generation: Generation, now: Instant) -> u32 {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let last = map.get(&c).copied().unwrap_or(Grant {
            generation: 0,
            at: self.started,
            lease_ms: shoal_rpc::MAX_LEASE_MS,
        });
        let left = if last.generation < generation {
            last.left_ms(now)
        } else {
            0
        };
        // The caller fenced the component at `generation`: nothing newer
        // can be recorded.
        let recorded = Self::record(&mut map, c, generation, LEASE_MS, now);
        debug_assert!(recorded.is_ok(), "activation under an older generation");
        left
    }

    /// The component was just created here: no lease was ever granted on
    /// it, by this process or an earlier one.
    pub fn created(&self, c: ComponentId, now: Instant) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(c).or_insert(Grant {
            generation: 0,
            at: now,
            lease_ms: 0,
        });
    }

    /// The component is gone.
    pub fn forget(&self, c: ComponentId) {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_covers_one_clock_slow_and_one_fast() {
        // 2000 ms at 1% each way: 2000 * 1.01 / 0.99 = 2040.4.
        assert_eq!(with_drift_margin(2_000), 2_041);
        assert_eq!(with_drift_margin(0), 0);
        assert_eq!(with_drift_margin(u32::MAX), u32::MAX);
    }

    #[test]
    fn a_lease_holds_from_the_round_sent_and_never_shrinks() {
        let l = Lease::default();
        let t0 = Instant::now();
        assert!(!l.holds_at(t0), "no lease before the first renewal");
        l.renewed(t0);
        assert!(l.holds_at(t0 + Duration::from_millis(1_999)));
        assert!(!l.holds_at(t0 + Duration::from_millis(2_000)));
        // An older round answering late does not shorten it.
        l.renewed(t0 - Duration::from_millis(500));
        assert!(l.holds_at(t0 + Duration::from_millis(1_999)));
        l.end();
        assert!(!l.holds_at(t0));
    }

    #[test]
    fn activation_reports_what_is_left_of_an_older_generations_lease() {
        let start = Instant::now();
        let g = Grants::new(start);
        // Nothing granted since start: a lease of the longest kind may
        // have been granted just before.
        let max = with_drift_margin(shoal_rpc::MAX_LEASE_MS);
        assert_eq!(g.activate(1, 5, start), max);
        // That activation granted generation 5 a lease; generation 6
        // waits for it.
        let t = start + Duration::from_millis(500);
        assert_eq!(g.grant(1, 5, LEASE_MS, t), Ok(()));
        let later = t + Duration::from_millis(1_000);
        assert_eq!(g.activate(1, 6, later), with_drift_margin(LEASE_MS) - 1_000);
        // Long after, nothing is left; the same generation waits for nothing.
        let much_later = later + Duration::from_secs(60);
        assert_eq!(g.activate(1, 7, much_later), 0);
        assert_eq!(g.activate(1, 7, much_later), 0);
        // A renewal of generation 5 that raced the activation of 7 is refused.
        assert_eq!(g.grant(1, 5, LEASE_MS, much_later), Err(7));
        g.forget(1);
        assert_eq!(g.activate(1, 8, much_later), 0, "start is long past");
        // A component made by this process was never leased.
        g.created(2, start);
        assert_eq!(g.activate(2, 1, start), 0);
    }
}
