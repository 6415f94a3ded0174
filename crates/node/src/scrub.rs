//! The scrubber: reads every written block of every component on this
//! node's devices in the background, at a bounded rate, and has the volume's
//! owner repair each block that fails its checksum from a healthy copy.
//!
//! It owns only its pacing and its counters. It never writes to a store
//! itself: a repair goes through the owner (`VolumeOp::Repair`), which
//! reads the block from an in-sync copy and sends it to this replica, so
//! repairs are ordered with the volume's writes like any other write.

use crate::replica::Replicas;
use crate::router::Router;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use shoal_rpc::VolumeOp;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How the scrubber paces itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScrubConfig {
    /// Read rate of the scrubber per node, in MiB/s of written data; 0
    /// turns it off. Low by default: it competes with clients for the
    /// device, and a pass over a full device may take days without harm.
    pub mib_per_s: u32,
    /// Pause between the end of one pass and the start of the next, in
    /// hours (vSAN checks each object about once a year; a week finds latent
    /// errors sooner while costing little). `POST /v1/scrub` starts a pass
    /// at once.
    pub interval_h: u64,
}

impl Default for ScrubConfig {
    fn default() -> Self {
        ScrubConfig {
            mib_per_s: 8,
            interval_h: 24 * 7,
        }
    }
}

/// Bytes read per step, in bytes: large enough to read efficiently, small
/// enough that pacing stays smooth.
const STEP: u64 = 1 << 20;

/// Counters, for `/metrics` and `/v1/scrub`.
#[derive(Default)]
pub struct ScrubStats {
    /// Passes over every component finished.
    pub passes: AtomicU64,
    /// Bytes of written data checked.
    pub bytes: AtomicU64,
    /// Bad blocks found.
    pub bad: AtomicU64,
    /// Bad blocks the owner replaced with a good copy.
    pub repaired: AtomicU64,
    /// Bad blocks left bad (no healthy copy, owner unreachable).
    pub unrepaired: AtomicU64,
    /// 1 while a pass runs.
    pub running: AtomicU64,
}

/// Handle to the scrubber of a node.
pub struct Scrubber {
    pub stats: ScrubStats,
    kick: Notify,
}

impl Scrubber {
    /// Starts the scrubber task.
    pub fn start(cfg: ScrubConfig, replicas: Arc<Replicas>, router: Arc<Router>) -> Arc<Scrubber> {
        let s = Arc::new(Scrubber {
            stats: ScrubStats::default(),
            kick: Notify::new(),
        });
        let me = s.clone();
        tokio::spawn(async move { me.run(cfg, replicas, router).await });
        s
    }

    /// Starts a pass now (or right after the running one).
    pub fn start_pass(&self) {
        self.kick.notify_one();
    }

    async fn run(&self, cfg: ScrubConfig, replicas: Arc<Replicas>, router: Arc<Router>) {
        let interval = Duration::from_secs(cfg.interval_h.saturating_mul(3600).max(1));
        // The first pass waits a full interval too: a node that restarts
        // often should not rescan everything each time.
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval), if cfg.mib_per_s > 0 => {}
                _ = self.kick.notified() => {}
            }
            // A pass asked for by hand runs even when pacing is off, at the
            // default rate.
            let rate = if cfg.mib_per_s > 0 {
                cfg.mib_per_s
            } else {
                ScrubConfig::default().mib_per_s
            };
            self.stats.running.store(1, Relaxed);
            self.pass(rate, &replicas, &router).await;
            self.stats.running.store(0, Relaxed);
            self.stats.passes.fetch_add(1, Relaxed);
        }
    }

    async fn pass(&self, mib_per_s: u32, replicas: &Replicas, router: &Router) {
        let bytes_per_s = mib_per_s as f64 * (1 << 20) as f64;
        let start = Instant::now();
        let mut done = 0u64;
        let (mut found, mut fixed) = (0u64, 0u64);
        // Devices by id, each looked up again at every step: a device
        // removed meanwhile is not kept open by a pass (`crate::devices`).
        let ids: Vec<_> = replicas.devices().iter().map(|d| d.id).collect();
        'devices: for dev in ids {
            let Some(comps) = replicas.device(dev).map(|d| d.store.components()) else {
                continue;
            };
            for c in comps {
                let Some(ranges) = replicas.device(dev).map(|d| d.store.allocated_ranges(c.id))
                else {
                    continue 'devices;
                };
                for (off, len) in ranges {
                    let mut at = off;
                    while at < off + len {
                        let n = (off + len - at).min(STEP);
                        // Pace: never ahead of the rate since the pass began.
                        let due = Duration::from_secs_f64(done as f64 / bytes_per_s);
                        if let Some(wait) = due.checked_sub(start.elapsed()) {
                            tokio::time::sleep(wait).await;
                        }
                        let Some(d) = replicas.device(dev) else {
                            continue 'devices;
                        };
                        let (d2, id) = (d.clone(), c.id);
                        let r =
                            tokio::task::spawn_blocking(move || d2.store.scrub_range(id, at, n))
                                .await;
                        done += n;
                        self.stats.bytes.fetch_add(n, Relaxed);
                        let bad = match r {
                            Ok(Ok(bad)) => bad,
                            // Deleted meanwhile, or an I/O error that the
                            // data path will report: next component.
                            Ok(Err(e)) => {
                                tracing::debug!(component = c.id, "scrub stopped: {e}");
                                break;
                            }
                            Err(_) => break,
                        };
                        for b in bad {
                            found += 1;
                            self.stats.bad.fetch_add(1, Relaxed);
                            d.checksum_errors.fetch_add(1, Relaxed);
                            let op = VolumeOp::Repair {
                                component: c.id,
                                offset: b,
                            };
                            match router.io(c.volume, op, Bytes::new()).await {
                                Ok(_) => {
                                    fixed += 1;
                                    self.stats.repaired.fetch_add(1, Relaxed);
                                }
                                Err(e) => {
                                    tracing::warn!(
                                        component = c.id,
                                        offset = b,
                                        "scrub: bad block not repaired: {e:?}"
                                    );
                                    self.stats.unrepaired.fetch_add(1, Relaxed);
                                }
                            }
                        }
                        at += n;
                    }
                }
            }
        }
        tracing::info!(
            bytes = done,
            bad = found,
            repaired = fixed,
            secs = start.elapsed().as_secs_f64(),
            "scrub pass done"
        );
    }
}
