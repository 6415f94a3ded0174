use super::*;
use crate::tests::{cluster, dev, pol, volume_from, G};
use crate::{fits, place};
use proptest::prelude::*;
use shoal_model::{DeviceState, Reconfig};

/// A node of its own fault domain, up.
fn node(id: NodeId) -> NodeInfo {
    crate::tests::node(id, &format!("node-{id}"), true)
}

/// A volume placed by `place` under `policy`, every component active,
/// ids from 100.
fn volume(policy: &str, nodes: &[NodeInfo], devs: &[DeviceInfo]) -> Volume {
    let policy = pol(policy);
    let plan = place(&policy, G, nodes, devs).unwrap();
    volume_from(&plan, policy, G)
}

/// The volume as the change leaves it: kept components and added ones.
fn after(v: &Volume, ch: &PolicyChange) -> Vec<(ComponentRole, NodeId)> {
    let mut out: Vec<(ComponentRole, NodeId)> = v
        .components
        .iter()
        .filter(|c| !ch.remove.contains(&c.id))
        .map(|c| (c.role, c.node))
        .collect();
    out.extend(ch.add.iter().map(|p| (p.role, p.node)));
    out
}

fn roles(layout: &[(ComponentRole, NodeId)]) -> (usize, usize) {
    let data = layout
        .iter()
        .filter(|(r, _)| *r == ComponentRole::Data)
        .count();
    (data, layout.len() - data)
}

#[test]
fn raising_ftt_adds_a_copy_and_a_witness_on_unused_domains() {
    let (nodes, devs) = cluster(5);
    let v = volume("raid1 ftt=1", &nodes, &devs);
    let ch = policy_change(&v, &pol("raid1 ftt=2"), &nodes, &devs).unwrap();
    assert!(ch.remove.is_empty());
    // Nodes 1-3 hold the volume; node 4 has more room than node 5.
    assert_eq!(
        ch.add,
        vec![
            Planned {
                role: ComponentRole::Data,
                node: 4,
                device: 14,
                votes: 1
            },
            Planned {
                role: ComponentRole::Witness,
                node: 5,
                device: 15,
                votes: 1
            },
        ]
    );
    let layout = after(&v, &ch);
    assert_eq!(roles(&layout), (3, 2));
    let nodes: BTreeSet<NodeId> = layout.iter().map(|(_, n)| *n).collect();
    assert_eq!(nodes.len(), 5, "five distinct nodes");
    // From nothing but a copy: a copy and a witness.
    let v = volume("ftt=0", &cluster(3).0, &cluster(3).1);
    let (nodes, devs) = cluster(3);
    let ch = policy_change(&v, &pol("raid1 ftt=1"), &nodes, &devs).unwrap();
    assert_eq!(roles(&after(&v, &ch)), (2, 1));
    assert!(ch.remove.is_empty());
}

#[test]
fn lowering_ftt_drops_what_does_not_serve_first_then_the_most_loaded() {
    let (mut nodes, mut devs) = cluster(5);
    let mut v = volume("raid1 ftt=2", &nodes, &devs);
    // Data on nodes 1-3 (the roomiest), witnesses on 4 and 5.
    let id_on = |v: &Volume, n: NodeId| v.components.iter().find(|c| c.node == n).unwrap().id;
    let ch = policy_change(&v, &pol("raid1 ftt=1"), &nodes, &devs).unwrap();
    assert!(ch.add.is_empty());
    // Everything serves: the copy and the witness on the most loaded
    // devices go (node 3 of the copies, node 5 of the witnesses).
    assert_eq!(ch.remove, vec![id_on(&v, 3), id_on(&v, 5)]);
    assert_eq!(roles(&after(&v, &ch)), (2, 1));
    // A copy that is absent goes first, then one whose node is down, or
    // whose device failed.
    v.components.iter_mut().find(|c| c.node == 1).unwrap().state = ComponentState::Absent;
    let ch = policy_change(&v, &pol("raid1 ftt=1"), &nodes, &devs).unwrap();
    assert_eq!(ch.remove, vec![id_on(&v, 1), id_on(&v, 5)]);
    v.components.iter_mut().find(|c| c.node == 1).unwrap().state = ComponentState::Active;
    nodes[1].state = NodeState::Down;
    devs[3].state = DeviceState::Failed;
    let ch = policy_change(&v, &pol("raid1 ftt=1"), &nodes, &devs).unwrap();
    assert_eq!(ch.remove, vec![id_on(&v, 2), id_on(&v, 4)]);
    // So does a copy on a node in maintenance.
    let (nodes, mut devs) = cluster(5);
    devs[0].maintenance = true;
    let ch = policy_change(&v, &pol("raid1 ftt=1"), &nodes, &devs).unwrap();
    assert_eq!(ch.remove, vec![id_on(&v, 1), id_on(&v, 5)]);
}

#[test]
fn down_to_ftt0_keeps_one_active_copy_and_no_witness() {
    let (nodes, devs) = cluster(3);
    let mut v = volume("raid1 ftt=1", &nodes, &devs);
    let ch = policy_change(&v, &pol("ftt=0"), &nodes, &devs).unwrap();
    let layout = after(&v, &ch);
    assert_eq!(roles(&layout), (1, 0));
    // The active copy is the one kept, whichever device is fuller.
    let kept = layout[0].1;
    let other = v.data_components().find(|c| c.node != kept).unwrap().node;
    v.components
        .iter_mut()
        .find(|c| c.node == kept)
        .unwrap()
        .state = ComponentState::Resyncing;
    let ch = policy_change(&v, &pol("ftt=0"), &nodes, &devs).unwrap();
    assert_eq!(after(&v, &ch), vec![(ComponentRole::Data, other)]);
    // No active copy at all: nothing to keep.
    for c in &mut v.components {
        c.state = ComponentState::Absent;
    }
    let e = policy_change(&v, &pol("ftt=0"), &nodes, &devs).unwrap_err();
    assert_eq!(e, PlacementError::NoCopyInSync { volume: "v".into() });
    let e = policy_change(&v, &pol("ftt=2"), &nodes, &devs).unwrap_err();
    assert!(matches!(e, PlacementError::NoCopyInSync { .. }), "{e}");
}

#[test]
fn too_few_domains_and_too_little_space_are_refused_with_the_reason() {
    let (nodes, mut devs) = cluster(5);
    let v = volume("raid1 ftt=1", &nodes, &devs);
    let e = policy_change(&v, &pol("raid1 ftt=3"), &nodes, &devs).unwrap_err();
    assert_eq!(
        e.to_string(),
        "raid1 ftt=3 needs 7 fault domains; the cluster has 5"
    );
    // A domain that is down does not count.
    let (mut nodes4, devs4) = cluster(5);
    nodes4[4].state = NodeState::Down;
    let e = policy_change(&v, &pol("raid1 ftt=2"), &nodes4, &devs4).unwrap_err();
    assert_eq!(
        e.to_string(),
        "raid1 ftt=2 needs 5 fault domains; the cluster has 4"
    );
    // Fully reserved copies need the whole size on the new copy's device.
    for d in &mut devs[3..] {
        d.used = d.capacity - G / 2;
    }
    let e = policy_change(&v, &pol("raid1 ftt=2 reserve=100"), &nodes, &devs).unwrap_err();
    assert!(
        matches!(e, PlacementError::NoSpace { needed, .. } if needed == G),
        "{e}"
    );
    assert!(e.to_string().contains("not enough space"), "{e}");
    // A witness needs no room.
    let ch = policy_change(&v, &pol("raid1 ftt=2"), &nodes, &devs).unwrap();
    assert_eq!(ch.add.len(), 2);
}

#[test]
fn a_change_in_progress_is_refused_and_the_same_policy_moves_nothing() {
    let (nodes, devs) = cluster(5);
    let mut v = volume("raid1 ftt=1", &nodes, &devs);
    let same = policy_change(&v, &pol("raid1 ftt=1"), &nodes, &devs).unwrap();
    assert!(same.moves_nothing());
    // Other words of the policy alone move nothing either.
    let words = policy_change(&v, &pol("raid1 ftt=1 reserve=50 iops=100"), &nodes, &devs);
    assert!(words.unwrap().moves_nothing());
    v.reconfig = Some(Reconfig {
        reason: "rebuild of component 100".into(),
        added: vec![],
        remove: vec![100],
        policy: None,
    });
    let e = policy_change(&v, &pol("raid1 ftt=2"), &nodes, &devs).unwrap_err();
    assert_eq!(
        e.to_string(),
        "volume v is already being reconfigured (rebuild of component 100): one change at a time"
    );
}

#[test]
fn a_layout_with_an_even_number_of_votes_is_refused() {
    let (nodes, devs) = cluster(5);
    let mut v = volume("raid1 ftt=1", &nodes, &devs);
    v.components[0].votes = 2;
    let e = policy_change(&v, &pol("raid1 ftt=2"), &nodes, &devs).unwrap_err();
    assert_eq!(
        e,
        PlacementError::EvenVotes {
            volume: "v".into(),
            votes: 6
        }
    );
}

/// A cluster of 1 to 9 nodes, each its own domain or sharing one, up or
/// down, with one or two devices of random fill and state.
fn arb_cluster() -> impl Strategy<Value = (Vec<NodeInfo>, Vec<DeviceInfo>)> {
    prop::collection::vec(
        (
            0u8..6,
            prop::bool::weighted(0.85),
            prop::collection::vec((0u64..100, 0u8..10), 1..=2),
        ),
        1..=9,
    )
    .prop_map(|spec| {
        let mut nodes = Vec::new();
        let mut devs = Vec::new();
        for (i, (dom, up, ds)) in spec.into_iter().enumerate() {
            let id = i as u64 + 1;
            let mut n = node(id);
            n.fault_domain = format!("d{}", if dom < 4 { id } else { u64::from(dom) });
            n.state = if up { NodeState::Up } else { NodeState::Down };
            nodes.push(n);
            for (used, st) in ds {
                let mut d = dev(100 + devs.len() as u64, id, 100 * G, used * G);
                d.state = match st {
                    0 => DeviceState::Failed,
                    1 => DeviceState::Full,
                    _ => DeviceState::Healthy,
                };
                devs.push(d);
            }
        }
        (nodes, devs)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Whatever the cluster, a change either is refused or leaves the
    /// layout the new policy asks for: `ftt + 1` copies and `ftt`
    /// witnesses of one vote each, an active copy among them, every added
    /// one on a usable device of a domain and node the volume did not
    /// use, with the space; and the same question gets the same answer.
    #[test]
    fn a_change_leaves_the_layout_of_the_new_policy(
        (nodes, devs) in arb_cluster(),
        from in 0u8..=3,
        to in 0u8..=3,
        reserve in prop_oneof![Just(0u8), Just(50), Just(100)],
        absent in prop::collection::vec(prop::bool::weighted(0.2), 7),
    ) {
        let old = Policy { ftt: from, ..Policy::default() };
        let Ok(plan) = place(&old, G, &nodes, &devs) else { return Ok(()) };
        let mut v = volume(&old.to_string(), &nodes, &devs);
        prop_assert_eq!(plan.len(), v.components.len());
        for (c, a) in v.components.iter_mut().zip(&absent) {
            if *a {
                c.state = ComponentState::Absent;
            }
        }
        let new = Policy { ftt: to, reserve_pct: reserve, ..Policy::default() };
        let r = policy_change(&v, &new, &nodes, &devs);
        prop_assert_eq!(&r, &policy_change(&v, &new, &nodes, &devs));
        let Ok(ch) = r else { return Ok(()) };
        let layout = after(&v, &ch);
        prop_assert_eq!(roles(&layout), (new.copies(), new.witnesses()));
        prop_assert!(ch.remove.iter().all(|id| v.components.iter().any(|c| c.id == *id)));
        let kept_active = v.data_components().any(|c| {
            !ch.remove.contains(&c.id) && c.state == ComponentState::Active
        });
        prop_assert!(kept_active);
        if to >= from {
            prop_assert!(ch.remove.is_empty());
        } else {
            prop_assert!(ch.add.is_empty());
        }
        let domain = |n: NodeId| nodes.iter().find(|x| x.id == n).unwrap().fault_domain.clone();
        let mut doms: BTreeSet<String> = v.components.iter().map(|c| domain(c.node)).collect();
        let need = reserved_bytes(&new, G);
        for p in &ch.add {
            prop_assert_eq!(p.votes, 1);
            let d = devs.iter().find(|d| d.id == p.device).unwrap();
            let n = nodes.iter().find(|n| n.id == p.node).unwrap();
            prop_assert_eq!(d.node, n.id);
            prop_assert_eq!(n.state, NodeState::Up);
            prop_assert_eq!(d.state, DeviceState::Healthy);
            if p.role == ComponentRole::Data {
                prop_assert!(fits(d, need));
            }
            prop_assert!(doms.insert(n.fault_domain.clone()), "domain used twice");
        }
        let votes: u32 = layout.len() as u32;
        prop_assert_eq!(votes, 2 * u32::from(to) + 1);
    }
}
