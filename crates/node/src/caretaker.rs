//! Keeps an owner on every volume that needs healing, with or without
//! client I/O: only an owner resyncs a copy that came back, rebuilds a
//! lost one after the repair delay, or carries a change of layout through
//! (`docs/reconfiguration.md`), and an owner otherwise starts only when a
//! client does I/O. Every [`CARE_INTERVAL_MS`], each node claims the
//! volumes that have needed one for [`CARE_GRACE_S`], have no live owner,
//! and name this node their caretaker: the node of their lowest-numbered
//! active data copy whose node is up (one node per volume, spread over the
//! cluster, and one that holds an up-to-date copy).
//!
//! A policy change that ended aborted (an added copy's node died) is
//! still wanted (`Volume::wanted_policy`): the volume's caretaker begins
//! it again once it has waited [`POLICY_RETRY_S`], placed afresh on the
//! nodes up by then, and again every [`POLICY_RETRY_S`] while placement
//! refuses it.
//!
//! An erasure-coded volume whose geometry is not the one its layout takes
//! on the cluster as it is now (RAID-5 2+1 on 3 to 5 fault domains, 4+1 on
//! 6 or more: vSAN ESA's adaptive RAID-5) is restriped by its caretaker
//! once that has held for the repair delay: a host gone that long is gone
//! for good, one there that long is there to stay
//! (`docs/erasure-coding.md`, Restripe).
//!
//! Owns nothing but its timers; claims through the router like client
//! I/O, and begins changes through `crate::policy_change` like the API.

use crate::router::Router;
use shoal_directory::ClusterState;
use shoal_model::{
    ComponentRole, ComponentState, NodeId, NodeState, Policy, StripeGeometry, Volume, VolumeId,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often the caretaker looks for volumes without an owner, in
/// milliseconds: a heal starts within this of its volume losing its owner
/// (against a repair delay of a minute or more, and resyncs of seconds).
pub const CARE_INTERVAL_MS: u64 = 1000;

/// Whether `v` needs an owner to heal: a component not active or on a
/// node that is down (the directory marks nothing itself: an owner records
/// the copy absent), a change of layout in progress, or a growth that
/// its owner commits (an erasure-coded volume's, `Volume::grow_to`).
pub fn needs_owner(state: &ClusterState, v: &Volume) -> bool {
    let up = |n: NodeId| {
        state
            .nodes
            .get(&n)
            .is_some_and(|n| n.state == NodeState::Up)
    };
    v.reconfig.is_some()
        || v.grow_to.is_some()
        || v.components
            .iter()
            .any(|c| c.state != ComponentState::Active || !up(c.node))
}

/// The node that keeps an owner on `v`: the node of its lowest-numbered
/// active data copy, if that node is up.
pub fn caretaker(state: &ClusterState, v: &Volume) -> Option<NodeId> {
    let up = |n: NodeId| {
        state
            .nodes
            .get(&n)
            .is_some_and(|n| n.state == NodeState::Up)
    };
    v.components
        .iter()
        .filter(|c| c.role == ComponentRole::Data && c.state == ComponentState::Active)
        .filter(|c| v.in_old_layout(c) && up(c.node))
        .min_by_key(|c| c.id)
        .map(|c| c.node)
}

/// Whether `v`'s owner (if any) runs on a node the directory has up.
fn owner_live(state: &ClusterState, v: &Volume) -> bool {
    v.owner
        .and_then(|o| state.nodes.get(&o))
        .is_some_and(|n| n.state == NodeState::Up)
}

/// The volumes this node (`me`) should claim now.
pub fn to_claim(state: &ClusterState, me: NodeId) -> Vec<VolumeId> {
    state
        .volumes
        .values()
        .filter(|v| v.problem.is_none() && needs_owner(state, v))
        .filter(|v| !owner_live(state, v) || v.owner == Some(me))
        .filter(|v| caretaker(state, v) == Some(me))
        .map(|v| v.id)
        .collect()
}

/// How long a wanted policy change waits, in seconds, after it ended
/// aborted (or was refused) before the caretaker begins it again: long
/// enough for the directory to find dead the node whose death aborted it
/// (so placement does not choose it again), short against a person
/// waiting for the change.
pub const POLICY_RETRY_S: u64 = 10;

/// The volumes whose caretaker is `me` and whose wanted policy change is
/// not in progress: (name, the policy), to begin again.
pub fn wanted_changes(state: &ClusterState, me: NodeId) -> Vec<(VolumeId, String, Policy)> {
    state
        .volumes
        .values()
        .filter(|v| v.reconfig.is_none() && v.problem.is_none())
        .filter_map(|v| {
            let p = v.wanted_policy.filter(|p| *p != v.policy)?;
            (caretaker(state, v) == Some(me)).then(|| (v.id, v.name.clone(), p))
        })
        .collect()
}

/// Begins again, once each has waited [`POLICY_RETRY_S`] since it was
/// last seen in progress (or tried), the policy changes this node takes
/// care of. `waiting` is when each became due.
async fn begin_wanted(
    router: &Router,
    waiting: &mut HashMap<VolumeId, Instant>,
    steps: &mut HashMap<VolumeId, Policy>,
) {
    let state = router.dir.state();
    note_steps(&state, steps);
    let due = wanted_changes(&state, router.node);
    waiting.retain(|v, _| due.iter().any(|(d, _, _)| d == v));
    for (volume, name, policy) in due {
        // One step of several committed: the next begins at once.
        let stepped = steps.get(&volume) == state.volumes.get(&volume).map(|v| &v.policy);
        let since = *waiting.entry(volume).or_insert_with(Instant::now);
        if stepped {
            steps.remove(&volume);
        } else if since.elapsed() < Duration::from_secs(POLICY_RETRY_S) {
            continue;
        }
        waiting.insert(volume, Instant::now());
        match crate::policy_change::change(&router.dir, &name, &policy).await {
            Ok(o) => tracing::info!(volume, %policy, "wanted policy change begun again: {o:?}"),
            Err(e) => tracing::warn!(volume, %policy, "wanted policy change not begun: {e}"),
        }
    }
}

/// The volumes whose caretaker is `me` and whose restripe is due:
/// (volume, name, the geometry the cluster gives now).
pub fn restripes_due(state: &ClusterState, me: NodeId) -> Vec<(VolumeId, String, StripeGeometry)> {
    state
        .volumes
        .values()
        .filter(|v| caretaker(state, v) == Some(me))
        .filter_map(|v| {
            let to = crate::policy_change::restripe_due(state, v)?;
            Some((v.id, v.name.clone(), to))
        })
        .collect()
}

/// Begins the restripes this node takes care of that have been due, to
/// the same geometry, for the repair delay as this node saw it.
/// `waiting`: since when each has been due, and to which geometry.
async fn begin_restripes(
    router: &Router,
    waiting: &mut HashMap<VolumeId, (StripeGeometry, Instant)>,
) {
    let state = router.dir.state();
    let delay = Duration::from_secs(state.settings.repair_delay_s);
    let due = restripes_due(&state, router.node);
    waiting.retain(|v, (g, _)| due.iter().any(|(d, _, to)| d == v && to == g));
    for (volume, name, to) in due {
        let since = waiting.entry(volume).or_insert((to, Instant::now())).1;
        if since.elapsed() < delay {
            continue;
        }
        // Tried once per delay: a refusal waits for the next.
        waiting.remove(&volume);
        match crate::policy_change::restripe(&router.dir, &name, to).await {
            Ok(o) => tracing::info!("restripe of volume {name} to {to} begun: {o:?}"),
            Err(e) => tracing::warn!("restripe of volume {name} to {to} not begun: {e}"),
        }
    }
}

/// Notes the policy of each step of a change of several (a change in
/// progress with a wanted policy beyond it) in `steps`: a volume found
/// with that policy later committed the step.
fn note_steps(state: &ClusterState, steps: &mut HashMap<VolumeId, Policy>) {
    steps.retain(|v, _| state.volumes.contains_key(v));
    for v in state.volumes.values() {
        let step = v.reconfig.as_ref().and_then(|r| r.policy);
        if let (Some(step), Some(wanted)) = (step, v.wanted_policy) {
            if step != wanted {
                steps.insert(v.id, step);
            }
        }
    }
}

/// How long a volume must have needed an owner, as this node saw it,
/// before its caretaker claims it, in seconds: while a cluster starts, its
/// nodes come up one after the other, and an owner claimed before the
/// last of them would record its copies absent and resync them needlessly.
pub const CARE_GRACE_S: u64 = 5;

/// Runs for as long as the node does.
pub async fn run(router: Arc<Router>) {
    let mut t = tokio::time::interval(Duration::from_millis(CARE_INTERVAL_MS));
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // Since when each volume has needed this node's care.
    let mut since: HashMap<VolumeId, Instant> = HashMap::new();
    let mut policies_waiting: HashMap<VolumeId, Instant> = HashMap::new();
    let mut steps: HashMap<VolumeId, Policy> = HashMap::new();
    let mut restripes: HashMap<VolumeId, (StripeGeometry, Instant)> = HashMap::new();
    loop {
        t.tick().await;
        begin_wanted(&router, &mut policies_waiting, &mut steps).await;
        begin_restripes(&router, &mut restripes).await;
        let state = router.dir.state();
        let due = to_claim(&state, router.node);
        since.retain(|v, _| due.contains(v));
        for volume in due {
            let first = *since.entry(volume).or_insert_with(Instant::now);
            if first.elapsed() < Duration::from_secs(CARE_GRACE_S) {
                continue;
            }
            if let Err(e) = router.ensure_owned(volume).await {
                tracing::debug!(volume, "caretaker cannot own the volume yet: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::mirrored;
    use shoal_directory::Command;

    /// Three nodes and a raid1 ftt=1 volume: copies on 1 and 2, witness on 3.
    fn cluster() -> (ClusterState, u64) {
        mirrored(3)
    }

    #[test]
    fn a_healthy_volume_is_left_alone() {
        let (s, _) = cluster();
        for me in 1..=3 {
            assert!(to_claim(&s, me).is_empty());
        }
    }

    #[test]
    fn the_node_of_the_first_live_copy_claims_a_volume_with_a_dead_copy() {
        let (mut s, v) = cluster();
        s.apply(&Command::SetNodeState {
            node: 1,
            state: NodeState::Down,
        })
        .unwrap();
        // Node 1's copy is out of reach; node 2 holds the other.
        assert_eq!(to_claim(&s, 2), vec![v]);
        assert!(to_claim(&s, 3).is_empty());
        // Once node 2 owns it, nobody else claims it.
        s.apply(&Command::ClaimOwner {
            volume: v,
            node: 2,
            expected_generation: s.volumes[&v].generation,
        })
        .unwrap();
        assert!(to_claim(&s, 3).is_empty());
        assert_eq!(to_claim(&s, 2), vec![v], "kept running by its caretaker");
    }

    /// A growth only an owner commits: its caretaker claims the volume.
    #[test]
    fn a_volume_being_grown_is_claimed_by_its_caretaker() {
        let (mut s, v) = cluster();
        let keeper = caretaker(&s, &s.volumes[&v]).unwrap();
        if let Some(vol) = s.volumes.get_mut(&v) {
            vol.grow_to = Some(vol.size * 2);
        }
        assert_eq!(to_claim(&s, keeper), vec![v]);
        assert!((1..=3)
            .filter(|&n| n != keeper)
            .all(|n| to_claim(&s, n).is_empty()));
    }

    /// Volume `v`'s caretaker, generation and witness.
    fn keeper_generation_witness(s: &ClusterState, v: VolumeId) -> (NodeId, u64, u64) {
        let vol = &s.volumes[&v];
        let witness = vol
            .components
            .iter()
            .find(|c| c.role == ComponentRole::Witness)
            .map(|c| c.id)
            .unwrap();
        (caretaker(s, vol).unwrap(), vol.generation, witness)
    }

    #[test]
    fn an_aborted_policy_change_is_left_to_the_caretaker_to_begin_again() {
        let (mut s, v) = cluster();
        let ftt0: Policy = "raid1 ftt=0".parse().unwrap();
        let (keeper, generation, witness) = keeper_generation_witness(&s, v);
        s.apply(&Command::BeginReconfig {
            volume: v,
            generation,
            add: vec![],
            remove: vec![witness],
            policy: Some(ftt0),
            reason: "policy raid1 ftt=0".into(),
            wanted: None,
        })
        .unwrap();
        // In progress: the owner carries it, nobody begins it.
        assert!((1..=3).all(|me| wanted_changes(&s, me).is_empty()));
        s.apply(&Command::AbortReconfig {
            volume: v,
            generation,
            added: vec![],
            remove: vec![witness],
        })
        .unwrap();
        // Aborted: its caretaker, and only it, begins it again.
        for me in 1..=3 {
            let want = if me == keeper {
                vec![(v, "v".to_string(), ftt0)]
            } else {
                vec![]
            };
            assert_eq!(wanted_changes(&s, me), want, "node {me}");
        }
        s.apply(&Command::KeepPolicy { volume: v }).unwrap();
        assert!(wanted_changes(&s, keeper).is_empty());
    }

    /// A step of several (raid1 ftt=1 to ftt=0, wanting raid1 ftt=0
    /// iops=500 beyond it) is noted while in progress; once committed the
    /// volume has the step's policy, still wants the end, and is due.
    #[test]
    fn a_committed_step_is_noted_so_the_next_begins_at_once() {
        let (mut s, v) = cluster();
        let (step, end): (Policy, Policy) = (
            "raid1 ftt=0".parse().unwrap(),
            "raid1 ftt=0 iops=500".parse().unwrap(),
        );
        let (keeper, generation, witness) = keeper_generation_witness(&s, v);
        let mut steps = HashMap::new();
        note_steps(&s, &mut steps);
        assert!(steps.is_empty());
        s.apply(&Command::BeginReconfig {
            volume: v,
            generation,
            add: vec![],
            remove: vec![witness],
            policy: Some(step),
            reason: "policy raid1 ftt=0 (towards raid1 ftt=0 iops=500)".into(),
            wanted: Some(end),
        })
        .unwrap();
        note_steps(&s, &mut steps);
        assert_eq!(steps.get(&v), Some(&step));
        s.apply(&Command::CommitReconfig {
            volume: v,
            generation,
            added: vec![],
            remove: vec![witness],
        })
        .unwrap();
        let vol = &s.volumes[&v];
        assert_eq!((vol.policy, vol.wanted_policy), (step, Some(end)));
        assert_eq!(
            steps.get(&v),
            Some(&vol.policy),
            "the step is seen committed"
        );
        assert_eq!(wanted_changes(&s, keeper), vec![(v, "v".to_string(), end)]);
    }
}
