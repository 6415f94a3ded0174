//! Node liveness: every node sends a heartbeat to every directory voter;
//! the leader marks a node down when its heartbeats stop and up when they
//! resume. Liveness lives in the voters' memory, never in the Raft log,
//! except for the up/down transitions themselves. Every voter keeps when it
//! last heard each node, so a newly elected leader (the old one may be the
//! host that was cut off) judges from what it heard before its election
//! instead of giving everyone a full timeout from its start: a dead
//! owner's node is marked down 3 s after it went silent, not 3 s after the
//! election that followed.

use shoal_api::{DeviceUsage, Heartbeat};
use shoal_directory::{Command, Directory};
use shoal_model::{DeviceId, DeviceState, NodeId, NodeState};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Interval between heartbeats, in milliseconds: a few per down timeout.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);
/// Silence after which the leader marks a node down, in seconds: several
/// missed heartbeats, so one slow round trip does not flap a node.
pub const DOWN_AFTER: Duration = Duration::from_secs(3);
/// Interval of the leader's check for silent nodes, in milliseconds: a
/// small part of the failover time.
const CHECK_EVERY: Duration = Duration::from_millis(250);
/// Usage changes smaller than this are not written to the directory (bytes).
const USAGE_STEP: u64 = 16 << 20;
/// How long a registered device must stay missing from its node's
/// heartbeats before the leader fails it, in seconds: a heartbeat composed
/// just before an add finished does not list the new device, and must not
/// fail it. Several heartbeats long, like `DOWN_AFTER`.
pub const UNSERVED_FAIL_AFTER: Duration = DOWN_AFTER;

pub struct Liveness {
    node: NodeId,
    dir: Directory,
    /// Proves this node to the leader (mutual TLS).
    transport: shoal_directory::Transport,
    seen: Mutex<HashMap<NodeId, Instant>>,
    leader_since: Mutex<Option<Instant>>,
    /// On the leader: since when each registered device has been missing
    /// from its node's heartbeats. Cleared when this node stops leading.
    unserved_since: Mutex<HashMap<DeviceId, Instant>>,
    /// The nodes' clock rates, as the leader measures them.
    pub clocks: crate::clock::ClockRates,
}

impl Liveness {
    /// The client this node calls other nodes' member routes with.
    pub fn transport(&self) -> &shoal_directory::Transport {
        &self.transport
    }

    pub fn new(node: NodeId, dir: Directory, transport: shoal_directory::Transport) -> Liveness {
        Liveness {
            node,
            dir,
            transport,
            seen: Mutex::new(HashMap::new()),
            leader_since: Mutex::new(None),
            unserved_since: Mutex::new(HashMap::new()),
            clocks: Default::default(),
        }
    }

    /// A heartbeat arrived (on a voter; only the leader acts on it).
    pub async fn heard(&self, hb: Heartbeat) {
        let now = Instant::now();
        if let Ok(mut s) = self.seen.lock() {
            s.insert(hb.node, now);
        }
        if !self.dir.is_leader() {
            return;
        }
        if let Some(ppm) = self.clocks.observe(hb.node, now, hb.mono_ms) {
            tracing::error!(
                node = hb.node,
                "node {}'s clock runs {ppm:+} ppm against the leader's: beyond the {} ppm \
                 the read lease assumes (docs/lease.md); fix its time source",
                hb.node,
                shoal_owner::lease::CLOCK_DRIFT_PPM
            );
        }
        let state = self.dir.state();
        if state.nodes.get(&hb.node).map(|n| n.state) == Some(NodeState::Down) {
            tracing::info!(node = hb.node, "node is back up");
            let _ = self
                .dir
                .propose(Command::SetNodeState {
                    node: hb.node,
                    state: NodeState::Up,
                })
                .await;
        }
        for (device, used) in self.long_unserved(&hb, &state, now) {
            tracing::warn!(
                node = hb.node,
                device,
                "device not served by its node for {UNSERVED_FAIL_AFTER:?}: failed"
            );
            let _ = self
                .dir
                .propose(Command::ReportDeviceUsage {
                    device,
                    used,
                    state: DeviceState::Failed,
                })
                .await;
        }
        for u in hb.devices {
            // A node reports its own devices only.
            let Some(d) = state.devices.get(&u.device).filter(|d| d.node == hb.node) else {
                continue;
            };
            if d.state != u.state || d.used.abs_diff(u.used) >= USAGE_STEP {
                let _ = self
                    .dir
                    .propose(Command::ReportDeviceUsage {
                        device: u.device,
                        used: u.used,
                        state: u.state,
                    })
                    .await;
            }
        }
    }

    /// A device registered for the heartbeat's node that the node has not
    /// served for `UNSERVED_FAIL_AFTER` (one that could not be opened at
    /// its start, or whose file is gone) is to be failed: placement skips
    /// it and a removal does not count on it. A node serving no device at
    /// all (still starting) fails none.
    fn long_unserved(
        &self,
        hb: &Heartbeat,
        state: &shoal_directory::ClusterState,
        now: Instant,
    ) -> Vec<(DeviceId, u64)> {
        let served: Vec<DeviceId> = hb.devices.iter().map(|u| u.device).collect();
        let Ok(mut since) = self.unserved_since.lock() else {
            return Vec::new();
        };
        let mut fail = Vec::new();
        for d in state.devices.values().filter(|d| d.node == hb.node) {
            if served.contains(&d.id) || served.is_empty() || d.state == DeviceState::Failed {
                since.remove(&d.id);
                continue;
            }
            let first = *since.entry(d.id).or_insert(now);
            if now.duration_since(first) >= UNSERVED_FAIL_AFTER {
                fail.push((d.id, d.used));
            }
        }
        fail
    }

    /// On the leader: mark silent nodes down.
    async fn check(&self) {
        if !self.dir.is_leader() {
            if let Ok(mut l) = self.leader_since.lock() {
                *l = None;
            }
            if let Ok(mut u) = self.unserved_since.lock() {
                u.clear();
            }
            return;
        }
        let now = Instant::now();
        let since = {
            let Ok(mut l) = self.leader_since.lock() else {
                return;
            };
            *l.get_or_insert(now)
        };
        let state = self.dir.state();
        let mut down = Vec::new();
        if let Ok(seen) = self.seen.lock() {
            for n in state.nodes.values() {
                if n.id == self.node || n.state != NodeState::Up {
                    continue;
                }
                // Heard before this node led, as a voter: judged from
                // then. Never heard: a full timeout from the leadership's
                // start.
                let last = seen.get(&n.id).copied().unwrap_or(since);
                if now.duration_since(last) > DOWN_AFTER {
                    down.push(n.id);
                }
            }
        }
        for id in down {
            tracing::warn!(
                node = id,
                "no heartbeat for {DOWN_AFTER:?}: marking node down"
            );
            let _ = self
                .dir
                .propose(Command::SetNodeState {
                    node: id,
                    state: NodeState::Down,
                })
                .await;
        }
    }

    /// Sends one heartbeat to every directory voter, each on its own task
    /// (to this node itself without the network): a voter that does not
    /// answer delays none of the others, nor the next round. A send lasts
    /// at most two intervals, so at most two wait per silent voter.
    async fn send_to_voters(self: &Arc<Self>, hb: Heartbeat) {
        let state = self.dir.state();
        for v in self.dir.voters() {
            if v == self.node {
                self.heard(hb.clone()).await;
                continue;
            }
            let Some(addr) = state.nodes.get(&v).map(|n| n.api_addr.clone()) else {
                continue;
            };
            let (me, hb) = (self.clone(), hb.clone());
            tokio::spawn(async move {
                let t = &me.transport;
                let url = format!("{}://{addr}/v1/heartbeat", t.scheme);
                let r = t
                    .client
                    .post(&url)
                    .timeout(HEARTBEAT_EVERY * 2)
                    .json(&hb)
                    .send()
                    .await
                    .and_then(|r| r.error_for_status());
                if let Err(e) = r {
                    tracing::debug!("heartbeat to {addr}: {e}");
                }
            });
        }
    }

    /// Runs the heartbeat sender and the leader's check until the process ends.
    pub fn spawn(self: &Arc<Self>, usage: impl Fn() -> Vec<DeviceUsage> + Send + Sync + 'static) {
        let me = self.clone();
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(HEARTBEAT_EVERY);
            iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                iv.tick().await;
                let hb = Heartbeat {
                    node: me.node,
                    devices: usage(),
                    mono_ms: crate::clock::mono_ms(),
                };
                me.send_to_voters(hb).await;
            }
        });
        let me = self.clone();
        tokio::spawn(async move {
            let mut iv = tokio::time::interval(CHECK_EVERY);
            loop {
                iv.tick().await;
                me.check().await;
            }
        });
    }
}

/// Below this much free space (bytes the store still takes) a device is
/// reported `Full`: the store refuses a write whose new blocks exceed what
/// is left, so `used` rarely reaches `capacity` exactly.
pub const FULL_BELOW: u64 = 1 << 20;

/// A device's health from what its node knows: `failed` once its store
/// answered an I/O error (it stays failed until the store is reopened);
/// `Full` when less than [`FULL_BELOW`] is left for new data (`free`:
/// capacity less used bytes less what reservations still lack), or when
/// a write was just refused for lack of space (`refused`: nothing was
/// allocated or freed since).
pub fn device_state(free: u64, failed: bool, refused: bool) -> DeviceState {
    if failed {
        DeviceState::Failed
    } else if free < FULL_BELOW || refused {
        DeviceState::Full
    } else {
        DeviceState::Healthy
    }
}

/// What a heartbeat reports about one of this node's devices. A refusal
/// for lack of space counts while usage stays where it was (a trim, a
/// deleted volume or a smaller write that still fit moved it since).
pub fn device_usage(d: &crate::replica::Device) -> DeviceUsage {
    let used = d.store.used();
    let refused = match d.refused_at.lock() {
        Ok(mut r) => {
            if r.is_some_and(|at| used != at) {
                *r = None;
            }
            r.is_some()
        }
        Err(_) => false,
    };
    let free = d
        .store
        .capacity()
        .saturating_sub(used)
        .saturating_sub(d.store.lacking(None));
    DeviceUsage {
        device: d.id,
        used,
        state: device_state(
            free,
            d.io_failed.load(std::sync::atomic::Ordering::Relaxed),
            refused,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_state_from_space_errors_and_refusals() {
        assert_eq!(device_state(1 << 30, false, false), DeviceState::Healthy);
        assert_eq!(device_state(FULL_BELOW, false, false), DeviceState::Healthy);
        assert_eq!(
            device_state(FULL_BELOW - 4096, false, false),
            DeviceState::Full
        );
        assert_eq!(device_state(0, false, false), DeviceState::Full);
        // A refused write: full even with space left (a large write).
        assert_eq!(device_state(1 << 30, false, true), DeviceState::Full);
        // I/O errors win over everything.
        assert_eq!(device_state(1 << 30, true, false), DeviceState::Failed);
        assert_eq!(device_state(0, true, true), DeviceState::Failed);
    }
}
