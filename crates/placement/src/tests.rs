use super::*;
use proptest::prelude::*;
use shoal_model::{Component, ComponentState, DeviceState, Layout};

pub(crate) fn node(id: NodeId, domain: &str, up: bool) -> NodeInfo {
    NodeInfo {
        id,
        fault_domain: domain.to_string(),
        peer_addr: String::new(),
        api_addr: String::new(),
        nbd_addr: String::new(),
        state: if up { NodeState::Up } else { NodeState::Down },
    }
}

pub(crate) fn dev(id: DeviceId, node: NodeId, capacity: u64, used: u64) -> DeviceInfo {
    DeviceInfo {
        id,
        node,
        path: format!("/dev/{id}"),
        capacity,
        used,
        reserved: 0,
        state: DeviceState::Healthy,
        provisioned: 0,
        maintenance: false,
        retiring: false,
        store_uuid: 0,
    }
}

pub(crate) const G: u64 = 1 << 30;

/// `n` nodes, one device each (device `10 + i` on node `i`), node `i`
/// with `i` GiB used of 100.
pub(crate) fn cluster(n: u64) -> (Vec<NodeInfo>, Vec<DeviceInfo>) {
    let nodes = (1..=n)
        .map(|i| node(i, &format!("node-{i}"), true))
        .collect();
    let devs = (1..=n).map(|i| dev(10 + i, i, 100 * G, i * G)).collect();
    (nodes, devs)
}

pub(crate) fn pol(s: &str) -> Policy {
    s.parse().unwrap()
}

#[test]
fn not_enough_domains_text() {
    let (nodes, devs) = cluster(4);
    let e = place(&pol("raid1 ftt=2"), G, &nodes, &devs).unwrap_err();
    assert_eq!(
        e.to_string(),
        "raid1 ftt=2 needs 5 fault domains; the cluster has 4"
    );
    // Extra policy words do not clutter the message.
    let e = place(&pol("raid1 ftt=2 reserve=100 iops=10"), G, &nodes, &devs).unwrap_err();
    assert_eq!(
        e.to_string(),
        "raid1 ftt=2 needs 5 fault domains; the cluster has 4"
    );
}

#[test]
fn counts_only_usable_domains() {
    let (mut nodes, mut devs) = cluster(5);
    nodes[0].state = NodeState::Down;
    devs[1].state = DeviceState::Failed;
    devs[2].state = DeviceState::Full;
    let e = place(&pol("ftt=1"), G, &nodes, &devs).unwrap_err();
    assert_eq!(
        e,
        PlacementError::NotEnoughFaultDomains {
            policy: "raid1 ftt=1".into(),
            needed: 3,
            have: 2
        }
    );
    // Two nodes in one domain count once.
    let (mut nodes, devs) = cluster(3);
    nodes[2].fault_domain = "node-2".into();
    assert!(matches!(
        place(&pol("ftt=1"), G, &nodes, &devs),
        Err(PlacementError::NotEnoughFaultDomains { have: 2, .. })
    ));
}

#[test]
fn places_ftt1_on_the_roomiest() {
    let (nodes, devs) = cluster(4);
    let p = place(&pol("ftt=1"), 10 * G, &nodes, &devs).unwrap();
    // Node 1 has the most free space, then node 2; the witness goes to the
    // least loaded of the rest (node 3).
    assert_eq!(
        p,
        vec![
            Planned {
                role: ComponentRole::Data,
                node: 1,
                device: 11,
                votes: 1
            },
            Planned {
                role: ComponentRole::Data,
                node: 2,
                device: 12,
                votes: 1
            },
            Planned {
                role: ComponentRole::Witness,
                node: 3,
                device: 13,
                votes: 1
            },
        ]
    );
}

#[test]
fn thick_needs_space_thin_does_not() {
    let (nodes, mut devs) = cluster(3);
    for d in &mut devs {
        d.capacity = 10 * G;
        d.used = 0;
    }
    devs[0].used = 9 * G;
    devs[1].used = 9 * G;
    // Thin: 50 GiB on 1-10 GiB free is fine.
    assert!(place(&pol("ftt=1"), 50 * G, &nodes, &devs).is_ok());
    // Thick: only node 3 has 5 GiB.
    let e = place(&pol("ftt=1 reserve=100"), 5 * G, &nodes, &devs).unwrap_err();
    assert_eq!(
        e,
        PlacementError::NoSpace {
            needed: 5 * G,
            domain: "node-1".into()
        }
    );
    assert!(e.to_string().contains("5 GiB"), "{e}");
    // 50%: 2 GiB of a 4 GiB volume... still only one domain fits.
    assert!(place(&pol("ftt=1 reserve=50"), 4 * G, &nodes, &devs).is_err());
    assert!(place(&pol("ftt=1 reserve=50"), 2 * G, &nodes, &devs).is_ok());
    // A completely full device cannot take even a thin copy.
    devs[0].used = 10 * G;
    devs[1].used = 10 * G;
    let e = place(&pol("ftt=1"), G, &nodes, &devs).unwrap_err();
    assert!(matches!(e, PlacementError::NoSpace { needed: 0, .. }));
    assert!(e.to_string().contains("thin"), "{e}");
    // ...but a witness may live there.
    devs[1].used = 0;
    let p = place(&pol("ftt=1"), G, &nodes, &devs).unwrap();
    assert_eq!(p[2].node, 1);
}

/// A volume of `plan`, every component active, ids from 100.
pub(crate) fn volume_from(plan: &[Planned], policy: Policy, size: u64) -> Volume {
    Volume {
        id: 7,
        name: "v".into(),
        size,
        policy,
        components: plan
            .iter()
            .enumerate()
            .map(|(i, p)| Component {
                id: 100 + i as u64,
                role: p.role,
                node: p.node,
                device: p.device,
                state: ComponentState::Active,
                votes: p.votes,
            })
            .collect(),
        owner: None,
        generation: 1,
        problem: None,
        wrapped_key: None,
        reconfig: None,
        wanted_policy: None,
        grow_to: None,
        map_log_at: None,
        stripe: stripe_geometry(&policy, plan),
    }
}

#[test]
fn replacement_uses_a_new_domain() {
    let (mut nodes, devs) = cluster(4);
    let policy = pol("ftt=1");
    let plan = place(&policy, G, &nodes, &devs).unwrap();
    let vol = volume_from(&plan, policy, G);
    nodes[0].state = NodeState::Down; // node 1 holds component 100 (data)
    let r = replacement(&policy, &vol, 100, &nodes, &devs).unwrap();
    assert_eq!(
        r,
        Planned {
            role: ComponentRole::Data,
            node: 4,
            device: 14,
            votes: 1
        }
    );
    // No spare domain left once node 4 is down too.
    nodes[3].state = NodeState::Down;
    let e = replacement(&policy, &vol, 100, &nodes, &devs).unwrap_err();
    assert_eq!(
        e.to_string(),
        "raid1 ftt=1 needs 3 fault domains; the cluster has 2"
    );
    assert!(matches!(
        replacement(&policy, &vol, 5, &nodes, &devs),
        Err(PlacementError::NoSuchComponent {
            volume: 7,
            component: 5
        })
    ));
}

#[test]
fn replacement_falls_back_to_another_device_of_the_same_host() {
    let (nodes, mut devs) = cluster(3);
    devs.push(dev(99, 1, 100 * G, 0));
    let policy = pol("ftt=1");
    let plan = place(&policy, G, &nodes, &devs).unwrap();
    let vol = volume_from(&plan, policy, G);
    let failed = vol.components.iter().find(|c| c.node == 1).unwrap().clone();
    assert_eq!(failed.device, 99);
    devs.last_mut().unwrap().state = DeviceState::Failed;
    let r = replacement(&policy, &vol, failed.id, &nodes, &devs).unwrap();
    assert_eq!((r.node, r.device, r.role), (1, 11, failed.role));
}

#[test]
fn a_node_in_maintenance_gets_no_new_component() {
    let (nodes, mut devs) = cluster(4);
    let policy = pol("ftt=1");
    let vol = volume_from(&place(&policy, G, &nodes, &devs).unwrap(), policy, G);
    // Node 1 (the roomiest) in maintenance: a new volume avoids it, and
    // its copy of `vol` moves to the one domain left (node 4).
    devs[0].maintenance = true;
    let p = place(&policy, G, &nodes, &devs).unwrap();
    assert!(p.iter().all(|p| p.node != 1), "{p:?}");
    let on1 = vol.components.iter().find(|c| c.node == 1).unwrap().id;
    let r = replacement(&policy, &vol, on1, &nodes, &devs).unwrap();
    assert_eq!((r.node, r.device), (4, 14));
    // With node 4 in maintenance too, neither fits.
    devs[3].maintenance = true;
    assert!(matches!(
        place(&policy, G, &nodes, &devs),
        Err(PlacementError::NotEnoughFaultDomains { have: 2, .. })
    ));
    assert!(replacement(&policy, &vol, on1, &nodes, &devs).is_err());
}

#[test]
fn a_retiring_device_gets_no_new_component_and_its_copy_moves_beside_it() {
    let (nodes, mut devs) = cluster(3);
    let policy = pol("ftt=1");
    let vol = volume_from(&place(&policy, G, &nodes, &devs).unwrap(), policy, G);
    let on1 = vol.components.iter().find(|c| c.node == 1).unwrap().clone();
    // A second device on node 1, and the first one retiring: three nodes
    // leave no other domain, so the copy goes to the new device.
    let mut extra = dev(21, 1, 100 * G, 0);
    extra.path = "/b".into();
    devs.push(extra);
    let d = devs.iter_mut().find(|d| d.id == on1.device).unwrap();
    d.retiring = true;
    let r = replacement(&policy, &vol, on1.id, &nodes, &devs).unwrap();
    assert_eq!((r.node, r.device), (1, 21));
    let p = place(&policy, G, &nodes, &devs).unwrap();
    assert!(p.iter().all(|p| p.device != on1.device), "{p:?}");
}

#[derive(Debug, Clone)]
struct Cluster {
    nodes: Vec<NodeInfo>,
    devices: Vec<DeviceInfo>,
}

fn arb_cluster() -> impl Strategy<Value = Cluster> {
    // Per node: (domain, up, devices as (capacity, used, reserved, state)).
    let dev = (1u64..100, 0u64..100, 0u64..30, 0u8..12);
    let one = (
        0u8..9,
        prop::bool::weighted(0.9),
        prop::collection::vec(dev, 0..4),
    );
    (3usize..10, prop::collection::vec(one, 1..14)).prop_map(|(spread, ns)| {
        let mut nodes = Vec::new();
        let mut devices = Vec::new();
        for (i, (dom, up, ds)) in ns.into_iter().enumerate() {
            let id = i as u64 + 1;
            nodes.push(node(
                id,
                &format!("rack-{}", dom as usize % spread.max(1)),
                up,
            ));
            for (cap, used, res, st) in ds {
                let cap = cap * G;
                devices.push(DeviceInfo {
                    id: 1000 + devices.len() as u64,
                    node: id,
                    path: String::new(),
                    capacity: cap,
                    used: (used * G).min(cap),
                    reserved: res * G,
                    state: match st {
                        0 => DeviceState::Failed,
                        1 => DeviceState::Full,
                        _ => DeviceState::Healthy,
                    },
                    provisioned: 0,
                    maintenance: false,
                    retiring: false,
                    store_uuid: 0,
                });
            }
        }
        // A device of a node the cluster does not know.
        devices.push(DeviceInfo {
            id: 999,
            node: 777,
            path: String::new(),
            capacity: 100 * G,
            used: 0,
            reserved: 0,
            state: DeviceState::Healthy,
            provisioned: 0,
            maintenance: false,
            retiring: false,
            store_uuid: 0,
        });
        Cluster { nodes, devices }
    })
}

fn arb_policy() -> impl Strategy<Value = Policy> {
    let layout = prop_oneof![
        3 => Just(Layout::Raid1),
        1 => Just(Layout::Raid5),
        1 => Just(Layout::Raid6),
    ];
    (0u8..=3, prop_oneof![Just(0u8), Just(50), Just(100)], layout).prop_map(|(ftt, r, layout)| {
        Policy {
            layout,
            ftt: layout.fixed_ftt().unwrap_or(ftt),
            reserve_pct: r,
            ..Policy::default()
        }
    })
}

/// Checks the invariants of a plan against the cluster.
fn check_plan(
    c: &Cluster,
    policy: &Policy,
    size: u64,
    plan: &[Planned],
) -> Result<(), TestCaseError> {
    let data = plan
        .iter()
        .filter(|p| p.role == ComponentRole::Data)
        .count();
    let wit = plan
        .iter()
        .filter(|p| p.role == ComponentRole::Witness)
        .count();
    prop_assert_eq!(data, policy.copies());
    prop_assert_eq!(wit, policy.witnesses());
    let stripes: Vec<u8> = plan
        .iter()
        .filter_map(|p| match p.role {
            ComponentRole::Stripe { position } => Some(position),
            _ => None,
        })
        .collect();
    let geometry = StripeGeometry::for_layout(policy.layout, usable_count(c));
    prop_assert_eq!(stripe_geometry(policy, plan), geometry);
    let width = geometry.map_or(0, |g| g.width());
    prop_assert_eq!(stripes.clone(), (0..width as u8).collect::<Vec<_>>());
    // Each leg on distinct domains (and nodes) of its own.
    let (mut doms, mut nodes) = (
        [BTreeSet::new(), BTreeSet::new()],
        [BTreeSet::new(), BTreeSet::new()],
    );
    for p in plan {
        let stripe = matches!(p.role, ComponentRole::Stripe { .. });
        prop_assert_eq!(p.votes, if stripe { 0 } else { 1 });
        let n = c.nodes.iter().find(|n| n.id == p.node).unwrap();
        let d = c.devices.iter().find(|d| d.id == p.device).unwrap();
        prop_assert_eq!(n.state, NodeState::Up);
        prop_assert_eq!(d.state, DeviceState::Healthy);
        prop_assert_eq!(d.node, n.id);
        if p.role == ComponentRole::Data {
            prop_assert!(fits(d, reserved_bytes(policy, size)));
        }
        let leg = usize::from(stripe);
        prop_assert!(doms[leg].insert(n.fault_domain.clone()), "domain reused");
        prop_assert!(nodes[leg].insert(n.id), "node reused");
    }
    Ok(())
}

fn usable_count(c: &Cluster) -> usize {
    c.devices
        .iter()
        .filter(|d| d.state == DeviceState::Healthy)
        .filter_map(|d| {
            c.nodes
                .iter()
                .find(|n| n.id == d.node && n.state == NodeState::Up)
        })
        .map(|n| n.fault_domain.clone())
        .collect::<BTreeSet<_>>()
        .len()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn placements_are_valid_and_deterministic(
        c in arb_cluster(),
        policy in arb_policy(),
        size in 1u64..60,
        seed in any::<u64>(),
    ) {
        let size = size * G;
        let r = place(&policy, size, &c.nodes, &c.devices);
        // Same input in another order: same answer.
        let mut c2 = c.clone();
        let k = c2.nodes.len();
        c2.nodes.rotate_left((seed as usize) % k);
        c2.devices.reverse();
        prop_assert_eq!(&r, &place(&policy, size, &c2.nodes, &c2.devices));
        prop_assert_eq!(&r, &place(&policy, size, &c.nodes, &c.devices));
        let have = usable_count(&c);
        match r {
            Ok(plan) => {
                prop_assert!(have >= policy.fault_domains_needed());
                check_plan(&c, &policy, size, &plan)?;
            }
            Err(PlacementError::NotEnoughFaultDomains { needed, have: h, .. }) => {
                prop_assert_eq!(h, have);
                prop_assert_eq!(needed, policy.fault_domains_needed());
                prop_assert!(have < needed);
            }
            Err(PlacementError::NoSpace { .. }) => {
                prop_assert!(have >= policy.fault_domains_needed());
                // Really fewer domains with a fitting device than copies.
                let need = reserved_bytes(&policy, size);
                let fitting: BTreeSet<String> = c.devices.iter()
                    .filter(|d| d.state == DeviceState::Healthy && fits(d, need))
                    .filter_map(|d| c.nodes.iter().find(|n| n.id == d.node && n.state == NodeState::Up))
                    .map(|n| n.fault_domain.clone())
                    .collect();
                let columns = StripeGeometry::for_layout(policy.layout, have).map_or(0, |g| {
                    let need = need.div_ceil(u64::from(g.data));
                    let fit: BTreeSet<String> = c.devices.iter()
                        .filter(|d| d.state == DeviceState::Healthy && fits(d, need))
                        .filter_map(|d| c.nodes.iter().find(|n| n.id == d.node && n.state == NodeState::Up))
                        .map(|n| n.fault_domain.clone())
                        .collect();
                    if fit.len() < g.width() { usize::MAX } else { 0 }
                });
                prop_assert!(fitting.len() < policy.copies() || columns == usize::MAX);
            }
            Err(e) => prop_assert!(false, "unexpected {}", e),
        }
    }

    #[test]
    fn replacements_keep_domains_distinct(
        c in arb_cluster(),
        policy in arb_policy(),
        pick in any::<usize>(),
        kill_node in any::<bool>(),
    ) {
        let size = G;
        let Ok(plan) = place(&policy, size, &c.nodes, &c.devices) else { return Ok(()) };
        let vol = volume_from(&plan, policy, size);
        let failed = vol.components[pick % vol.components.len()].clone();
        // The plan is checked against the cluster before the failure: the
        // other leg of an erasure-coded volume may share the failed node
        // or device (its component is replaced on its own).
        let before = c.clone();
        let mut c = c;
        if kill_node {
            c.nodes.iter_mut().filter(|n| n.id == failed.node).for_each(|n| n.state = NodeState::Down);
        } else {
            c.devices.iter_mut().filter(|d| d.id == failed.device).for_each(|d| d.state = DeviceState::Failed);
        }
        let r = replacement(&policy, &vol, failed.id, &c.nodes, &c.devices);
        prop_assert_eq!(&r, &replacement(&policy, &vol, failed.id, &c.nodes, &c.devices));
        if let Ok(p) = r {
            prop_assert_eq!(p.role, failed.role);
            prop_assert!(p.device != failed.device);
            let mut new_plan: Vec<Planned> = plan.iter().enumerate()
                .filter(|(i, _)| vol.components[*i].id != failed.id)
                .map(|(_, p)| p.clone())
                .collect();
            let n = c.nodes.iter().find(|n| n.id == p.node).unwrap();
            let d = c.devices.iter().find(|d| d.id == p.device).unwrap();
            prop_assert_eq!((n.state, d.state), (NodeState::Up, DeviceState::Healthy));
            new_plan.push(p);
            new_plan.sort_by_key(|p| match p.role {
                ComponentRole::Stripe { position } => (1, position),
                _ => (0, 0),
            });
            check_plan(&before, &policy, size, &new_plan)?;
        }
    }
}

/// RAID-5 on 3 to 5 domains is 2+1, on 6 or more 4+1; RAID-6 is 4+2 and
/// needs 6. The performance leg is RAID-1's; the stripe columns share its
/// domains but not each other's, and carry no vote. A lost column is
/// replaced clear of the other columns.
#[test]
fn erasure_layouts_place_both_legs() {
    let r5 = Policy {
        layout: Layout::Raid5,
        ..Policy::default()
    };
    let r6 = Policy {
        layout: Layout::Raid6,
        ftt: 2,
        ..Policy::default()
    };
    for (n, policy, want) in [
        (3, r5, Some("2+1")),
        (5, r5, Some("2+1")),
        (6, r5, Some("4+1")),
        (8, r5, Some("4+1")),
        (6, r6, Some("4+2")),
        (2, r5, None),
        (5, r6, None),
    ] {
        let (nodes, devs) = cluster(n);
        match place(&policy, G, &nodes, &devs) {
            Ok(plan) => {
                let g = stripe_geometry(&policy, &plan).map(|g| g.to_string());
                assert_eq!(g.as_deref(), want, "{policy} on {n}");
                let c = Cluster {
                    nodes: nodes.clone(),
                    devices: devs.clone(),
                };
                check_plan(&c, &policy, G, &plan).unwrap();
                let vol = volume_from(&plan, policy, G);
                assert_eq!(vol.total_votes(), 2 * u32::from(policy.ftt) + 1);
                let column = vol.stripe_components().next().unwrap().clone();
                let mut down = nodes.clone();
                down.iter_mut()
                    .filter(|x| x.id == column.node)
                    .for_each(|x| x.state = NodeState::Down);
                match replacement(&policy, &vol, column.id, &down, &devs) {
                    Ok(p) => {
                        assert_eq!(p.role, column.role);
                        assert_eq!(p.votes, 0);
                        assert!(vol.stripe_components().all(|c| c.node != p.node));
                    }
                    // Every domain holds a column already.
                    Err(PlacementError::NotEnoughFaultDomains { .. }) => {
                        assert_eq!(vol.stripe_components().count(), n as usize)
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            Err(PlacementError::NotEnoughFaultDomains { needed, have, .. }) => {
                assert_eq!(want, None, "{policy} on {n}");
                assert_eq!((needed, have), (policy.fault_domains_needed(), n as usize));
            }
            Err(e) => panic!("{policy} on {n}: {e}"),
        }
    }
}

#[test]
fn ftt3_uses_seven_domains_and_balances() {
    let (mut nodes, devs) = cluster(9);
    // Two nodes share a rack: at most one of them is used.
    nodes[8].fault_domain = "node-8".into();
    let p = place(&pol("raid1 ftt=3"), G, &nodes, &devs).unwrap();
    let data: Vec<NodeId> = p
        .iter()
        .filter(|p| p.role == ComponentRole::Data)
        .map(|p| p.node)
        .collect();
    let wit: Vec<NodeId> = p
        .iter()
        .filter(|p| p.role == ComponentRole::Witness)
        .map(|p| p.node)
        .collect();
    // Domains with the most free space first (node i has i GiB used; rack
    // node-8 has two nodes, so the most free space in total), and in a
    // domain the roomiest device; witnesses on the least loaded of the rest.
    assert_eq!(data, vec![8, 1, 2, 3]);
    assert_eq!(wit, vec![4, 5, 6]);
    let c = Cluster {
        nodes: nodes.clone(),
        devices: devs.clone(),
    };
    check_plan(&c, &pol("raid1 ftt=3"), G, &p).unwrap();
    assert_eq!(p, place(&pol("raid1 ftt=3"), G, &nodes, &devs).unwrap());
}

#[test]
fn thin_volumes_spread_by_provisioned_bytes() {
    // Four empty nodes: the devices of the first volume's copies carry its
    // provisioned size, so the next thin volume goes to the other two.
    let (nodes, mut devs) = cluster(4);
    let first = place(&pol("raid1 ftt=1"), 10 * G, &nodes, &devs).unwrap();
    for p in first.iter().filter(|p| p.role == ComponentRole::Data) {
        let d = devs.iter_mut().find(|d| d.id == p.device).unwrap();
        d.provisioned += 10 * G;
    }
    let second = place(&pol("raid1 ftt=1"), 10 * G, &nodes, &devs).unwrap();
    let data = |plan: &[Planned]| -> Vec<NodeId> {
        plan.iter()
            .filter(|p| p.role == ComponentRole::Data)
            .map(|p| p.node)
            .collect()
    };
    for n in data(&second) {
        assert!(
            !data(&first).contains(&n),
            "second volume reused node {n}: {first:?} / {second:?}"
        );
    }
}
