//! Latency histograms (HDR, nanoseconds) and their summaries.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Highest latency recorded exactly; longer ones are clamped to it.
pub const MAX_NS: u64 = 600_000_000_000;

/// A latency histogram in nanoseconds, 3 significant digits.
#[derive(Clone, Debug)]
pub struct Lat(pub Histogram<u64>);

impl Default for Lat {
    fn default() -> Self {
        Lat::new()
    }
}

impl Lat {
    pub fn new() -> Lat {
        Lat(Histogram::new_with_bounds(1, MAX_NS, 3).expect("valid histogram bounds"))
    }

    pub fn record(&mut self, ns: u64) {
        self.0.saturating_record(ns.clamp(1, MAX_NS));
    }

    pub fn record_n(&mut self, ns: u64, n: u64) {
        self.0.saturating_record_n(ns.clamp(1, MAX_NS), n);
    }

    /// Adds every sample of `other`.
    pub fn merge(&mut self, other: &Lat) {
        // Same bounds, so this cannot fail.
        self.0.add(&other.0).expect("histograms with equal bounds");
    }

    pub fn count(&self) -> u64 {
        self.0.len()
    }

    pub fn summary(&self) -> LatSummary {
        let h = &self.0;
        if h.is_empty() {
            return LatSummary::default();
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        LatSummary {
            count: h.len(),
            mean_us: h.mean() / 1000.0,
            min_us: us(h.min()),
            p50_us: us(h.value_at_quantile(0.50)),
            p95_us: us(h.value_at_quantile(0.95)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        }
    }

    /// Points of the latency distribution for charts: (quantile, µs) at
    /// fixed quantiles from 0 to 0.99999 and the maximum (quantile 1).
    pub fn distribution(&self) -> Vec<(f64, f64)> {
        if self.0.is_empty() {
            return Vec::new();
        }
        DIST_QUANTILES
            .iter()
            .map(|&q| (q, self.0.value_at_quantile(q) as f64 / 1000.0))
            .collect()
    }
}

/// Quantiles sampled for the distribution chart.
pub const DIST_QUANTILES: &[f64] = &[
    0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.96, 0.97, 0.98,
    0.99, 0.995, 0.999, 0.9995, 0.9999, 0.99999, 1.0,
];

/// Latency figures in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatSummary {
    pub count: u64,
    pub mean_us: f64,
    pub min_us: f64,
    pub p50_us: f64,
    pub p95_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-9)
    }

    #[test]
    fn percentiles_of_a_uniform_range() {
        let mut h = Lat::new();
        for us in 1..=10_000u64 {
            h.record(us * 1000);
        }
        let s = h.summary();
        assert_eq!(s.count, 10_000);
        assert!(close(s.p50_us, 5000.0, 0.002), "{s:?}");
        assert!(close(s.p95_us, 9500.0, 0.002), "{s:?}");
        assert!(close(s.p99_us, 9900.0, 0.002), "{s:?}");
        assert!(close(s.p999_us, 9990.0, 0.002), "{s:?}");
        assert!(close(s.max_us, 10_000.0, 0.002), "{s:?}");
        assert!(close(s.min_us, 1.0, 0.002), "{s:?}");
        assert!(close(s.mean_us, 5000.5, 0.002), "{s:?}");
        assert!(s.p50_us <= s.p95_us && s.p95_us <= s.p99_us && s.p99_us <= s.max_us);
    }

    #[test]
    fn merging_equals_recording_everything_in_one() {
        let mut a = Lat::new();
        let mut b = Lat::new();
        let mut all = Lat::new();
        for i in 0..5000u64 {
            // two different distributions: fast reads and slow writes
            let fast = 50_000 + (i * 7919) % 100_000;
            let slow = 2_000_000 + (i * 104_729) % 8_000_000;
            a.record(fast);
            b.record(slow);
            all.record(fast);
            all.record(slow);
        }
        let mut m = Lat::new();
        m.merge(&a);
        m.merge(&b);
        assert_eq!(m.count(), 10_000);
        assert_eq!(m.summary(), all.summary());
        // half the samples are slow: the median sits at the boundary, p95 among the slow
        let s = m.summary();
        assert!(s.p50_us <= 2000.0 + 1.0 && s.p50_us >= 140.0, "{s:?}");
        assert!(s.p95_us > 2000.0, "{s:?}");
        // merging an empty histogram changes nothing
        m.merge(&Lat::new());
        assert_eq!(m.summary(), all.summary());
    }

    #[test]
    fn clamps_and_empty() {
        let mut h = Lat::new();
        assert_eq!(h.summary(), LatSummary::default());
        assert!(h.distribution().is_empty());
        h.record(0);
        h.record(u64::MAX);
        let s = h.summary();
        assert_eq!(s.count, 2);
        assert!(s.max_us >= MAX_NS as f64 / 1000.0 * 0.999);
        let d = h.distribution();
        assert_eq!(d.len(), DIST_QUANTILES.len());
        assert!(d.windows(2).all(|w| w[0].1 <= w[1].1));
    }
}
