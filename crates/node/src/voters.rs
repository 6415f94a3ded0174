//! Keeps the directory's fault tolerance: on the leader, a Raft voter whose
//! node stays down past the repair delay is replaced by a learner that is
//! up (the dead node stays a learner, and may be promoted again later).
//!
//! The same delay as for data: a host that reboots or is patched keeps its
//! vote, one that is gone for good gives it up. Only clusters with
//! learners can replace (a joining node becomes a voter while there are
//! fewer than five), so this matters from six nodes up.
//!
//! Owns: the decision and the leader's clock of how long each voter has
//! been down (in memory: a new leader waits the whole delay again). Must
//! never change data components or the directory's state: membership only,
//! through [`Directory::replace_voter`].

use shoal_directory::{ClusterState, Directory};
use shoal_model::{NodeId, NodeState};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Interval of the leader's look at its voters, in milliseconds: a
/// replacement waits minutes at least, so a second is plenty.
const CHECK_MS: u64 = 1_000;

/// The voter to replace and the learner to promote, if any: a voter whose
/// node has been down for `delay` (by `down_since`) and an up learner not
/// in maintenance, preferring a fault domain no remaining voter has, then
/// the lowest id.
pub fn replacement(
    state: &ClusterState,
    voters: &BTreeSet<NodeId>,
    members: &BTreeSet<NodeId>,
    down_since: &BTreeMap<NodeId, Instant>,
    now: Instant,
    delay: Duration,
) -> Option<(NodeId, NodeId)> {
    let dead = voters.iter().copied().find(|v| {
        down_since
            .get(v)
            .is_some_and(|&t| now.saturating_duration_since(t) >= delay)
    })?;
    let domain = |n: &NodeId| state.nodes.get(n).map(|i| i.fault_domain.clone());
    let used: BTreeSet<String> = voters
        .iter()
        .filter(|&&v| v != dead)
        .filter_map(domain)
        .collect();
    let up = |n: &NodeId| state.nodes.get(n).is_some_and(|i| i.state == NodeState::Up);
    let learner = members
        .difference(voters)
        .filter(|&n| up(n) && !state.maintenance.contains_key(n))
        .min_by_key(|&n| (domain(n).is_some_and(|d| used.contains(&d)), *n))?;
    Some((dead, *learner))
}

/// The leader's clock of down voters: when each was first seen down.
#[derive(Default)]
pub struct DownClock {
    since: BTreeMap<NodeId, Instant>,
}

impl DownClock {
    /// Updates the clock from `state` at `now` for `voters`: a voter seen
    /// down keeps its first time, one up (or no voter) is forgotten.
    pub fn observe(&mut self, state: &ClusterState, voters: &BTreeSet<NodeId>, now: Instant) {
        let down = |n: &NodeId| {
            state
                .nodes
                .get(n)
                .is_some_and(|i| i.state == NodeState::Down)
        };
        self.since.retain(|n, _| voters.contains(n) && down(n));
        for v in voters.iter().filter(|v| down(v)) {
            self.since.entry(*v).or_insert(now);
        }
    }

    pub fn since(&self) -> &BTreeMap<NodeId, Instant> {
        &self.since
    }

    /// Forgets everything (this node is no longer the leader).
    pub fn reset(&mut self) {
        self.since.clear();
    }
}

/// Runs the leader's look at its voters until the process ends.
pub async fn run(dir: Directory) {
    let mut clock = DownClock::default();
    let mut tick = tokio::time::interval(Duration::from_millis(CHECK_MS));
    loop {
        tick.tick().await;
        if !dir.is_leader() {
            clock.reset();
            continue;
        }
        let state: Arc<ClusterState> = dir.state();
        let voters: BTreeSet<NodeId> = dir.voters().into_iter().collect();
        let members: BTreeSet<NodeId> = dir.members().into_iter().collect();
        let now = Instant::now();
        clock.observe(&state, &voters, now);
        let delay = Duration::from_secs(state.settings.repair_delay_s);
        let Some((dead, learner)) =
            replacement(&state, &voters, &members, clock.since(), now, delay)
        else {
            continue;
        };
        tracing::info!(
            voter = dead,
            learner,
            "replacing a directory voter down longer than the repair delay"
        );
        match dir.replace_voter(dead, learner).await {
            Ok(()) => clock.reset(),
            Err(e) => tracing::warn!(voter = dead, learner, "replacing a voter: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_model::NodeInfo;

    const DELAY: Duration = Duration::from_secs(60);

    /// Nodes 1..=n, node i in fault domain `domains[i-1]`, those in `down`
    /// down.
    fn state(domains: &[&str], down: &[NodeId]) -> ClusterState {
        let mut s = ClusterState::default();
        for (i, d) in domains.iter().enumerate() {
            let id = i as NodeId + 1;
            let info = NodeInfo {
                id,
                fault_domain: d.to_string(),
                peer_addr: String::new(),
                api_addr: String::new(),
                nbd_addr: String::new(),
                state: if down.contains(&id) {
                    NodeState::Down
                } else {
                    NodeState::Up
                },
            };
            s.nodes.insert(id, info);
        }
        s
    }

    fn set(v: &[NodeId]) -> BTreeSet<NodeId> {
        v.iter().copied().collect()
    }

    #[test]
    fn a_voter_down_past_the_delay_is_replaced_by_an_up_learner_of_a_new_domain() {
        let s = state(&["a", "b", "c", "d", "e", "b", "f"], &[3]);
        let voters = set(&[1, 2, 3, 4, 5]);
        let members = set(&[1, 2, 3, 4, 5, 6, 7]);
        let t0 = Instant::now();
        let mut clock = DownClock::default();
        clock.observe(&s, &voters, t0);
        let at = |d| replacement(&s, &voters, &members, clock.since(), t0 + d, DELAY);
        assert_eq!(
            at(DELAY - Duration::from_secs(1)),
            None,
            "not before the delay"
        );
        // Node 6 shares domain b with voter 2: node 7 (domain f) is taken.
        assert_eq!(at(DELAY), Some((3, 7)));
    }

    #[test]
    fn no_learner_up_and_out_of_maintenance_means_no_replacement() {
        let mut s = state(&["a", "b", "c", "d", "e", "f", "g"], &[3, 6]);
        s.maintenance
            .insert(7, shoal_model::MaintenanceMode::NoDataMigration);
        let voters = set(&[1, 2, 3, 4, 5]);
        let members = set(&[1, 2, 3, 4, 5, 6, 7]);
        let t0 = Instant::now();
        let mut clock = DownClock::default();
        clock.observe(&s, &voters, t0);
        assert_eq!(
            replacement(&s, &voters, &members, clock.since(), t0 + DELAY, DELAY),
            None
        );
    }

    #[test]
    fn a_voter_back_up_restarts_its_clock() {
        let voters = set(&[1, 2, 3]);
        let t0 = Instant::now();
        let mut clock = DownClock::default();
        clock.observe(&state(&["a", "b", "c", "d"], &[2]), &voters, t0);
        clock.observe(&state(&["a", "b", "c", "d"], &[]), &voters, t0 + DELAY / 2);
        let s = state(&["a", "b", "c", "d"], &[2]);
        clock.observe(&s, &voters, t0 + DELAY);
        let members = set(&[1, 2, 3, 4]);
        let at = |d| replacement(&s, &voters, &members, clock.since(), d, DELAY);
        assert_eq!(at(t0 + DELAY + DELAY / 2), None);
        assert_eq!(at(t0 + 2 * DELAY), Some((2, 4)));
    }
}
