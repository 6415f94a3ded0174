//! Test fixtures of the node's pure planners (rebuild, caretaker,
//! maintenance, policy change): directory states built by applying
//! commands, as the cluster would.

use shoal_directory::{ClusterState, Command, PlannedComponent, Response};
use shoal_model::{ComponentRole, NodeInfo, NodeState, VolumeId};

/// Node `id`, up, its own fault domain.
pub(crate) fn node(id: u64) -> NodeInfo {
    NodeInfo {
        id,
        fault_domain: format!("node-{id}"),
        peer_addr: format!("10.0.0.{id}:7000"),
        api_addr: format!("10.0.0.{id}:8000"),
        nbd_addr: format!("10.0.0.{id}:10809"),
        state: NodeState::Up,
    }
}

/// `n` nodes with a 1 GiB device each, registered in order: device `i`
/// is node `i`'s.
pub(crate) fn nodes(n: u64) -> ClusterState {
    let mut s = ClusterState::default();
    for i in 1..=n {
        s.apply(&Command::RegisterNode { node: node(i) }).unwrap();
        s.apply(&Command::RegisterDevice {
            node: i,
            path: "/d".into(),
            capacity: 1 << 30,
            store_uuid: 0,
        })
        .unwrap();
    }
    s
}

/// Creates volume `name` of 1 MiB under `policy` with a component of each
/// role on each node of `on` (on that node's device).
pub(crate) fn create(
    s: &mut ClusterState,
    name: &str,
    policy: &str,
    on: &[(u64, ComponentRole)],
) -> VolumeId {
    let components = on
        .iter()
        .map(|&(node, role)| PlannedComponent {
            role,
            node,
            device: s.devices.values().find(|d| d.node == node).unwrap().id,
            votes: 1,
        })
        .collect();
    let Response::Id(v) = s
        .apply(&Command::CreateVolume {
            name: name.into(),
            size: 1 << 20,
            policy: policy.parse().unwrap(),
            wrapped_key: None,
            components,
        })
        .unwrap()
    else {
        panic!("no id");
    };
    v
}

/// `n` nodes and a `raid1 ftt=1` volume "v": copies on nodes 1 and 2,
/// witness on node 3.
pub(crate) fn mirrored(n: u64) -> (ClusterState, VolumeId) {
    let mut s = nodes(n);
    use ComponentRole::*;
    let v = create(
        &mut s,
        "v",
        "raid1 ftt=1",
        &[(1, Data), (2, Data), (3, Witness)],
    );
    (s, v)
}
