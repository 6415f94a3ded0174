//! The reconfiguration commands on a small cluster: four nodes with a
//! device each, a `raid1 ftt=1 reserve=100` volume with copies on nodes 1
//! and 2 and a witness on node 3.

use super::*;
use crate::state::tests::node;
use crate::state::Command;

const SIZE: u64 = 1 << 20;

fn planned(role: ComponentRole, node: u64, device: DeviceId) -> PlannedComponent {
    PlannedComponent {
        role,
        node,
        device,
        votes: 1,
    }
}

/// The cluster, its devices (node i holds devs[i-1]) and the volume.
fn setup() -> (ClusterState, Vec<DeviceId>, VolumeId) {
    let mut s = ClusterState::default();
    let mut devs = vec![];
    for n in 1..=4 {
        s.apply(&Command::RegisterNode { node: node(n) }).unwrap();
        let Response::Id(d) = s
            .apply(&Command::RegisterDevice {
                node: n,
                path: "/dev/a".into(),
                capacity: 4 * SIZE,
                store_uuid: 0,
            })
            .unwrap()
        else {
            panic!()
        };
        devs.push(d);
    }
    let Response::Id(v) = s
        .apply(&Command::CreateVolume {
            name: "v".into(),
            size: SIZE,
            policy: "raid1 ftt=1 reserve=100".parse().unwrap(),
            wrapped_key: None,
            components: vec![
                planned(ComponentRole::Data, 1, devs[0]),
                planned(ComponentRole::Data, 2, devs[1]),
                planned(ComponentRole::Witness, 3, devs[2]),
            ],
        })
        .unwrap()
    else {
        panic!()
    };
    (s, devs, v)
}

fn component_on(s: &ClusterState, v: VolumeId, node: u64) -> ComponentId {
    s.volumes[&v]
        .components
        .iter()
        .find(|c| c.node == node)
        .map(|c| c.id)
        .unwrap()
}

/// Replace the copy on node 2 by one on node 4.
fn begin_move(
    s: &mut ClusterState,
    devs: &[DeviceId],
    v: VolumeId,
) -> Result<Response, StateError> {
    let from = component_on(s, v, 2);
    s.apply(&Command::BeginReconfig {
        volume: v,
        generation: 0,
        add: vec![planned(ComponentRole::Data, 4, devs[3])],
        remove: vec![from],
        policy: None,
        reason: "rebuild of the copy on node 2".into(),
        wanted: None,
    })
}

#[test]
fn a_move_reserves_first_then_commits_the_new_layout() {
    let (mut s, devs, v) = setup();
    begin_move(&mut s, &devs, v).unwrap();
    let vol = &s.volumes[&v];
    let added = component_on(&s, v, 4);
    let dropped = component_on(&s, v, 2);
    assert_eq!(vol.reconfig.as_ref().unwrap().added, vec![added]);
    let c = |id| vol.components.iter().find(|c| c.id == id).unwrap();
    assert_eq!(c(added).state, ComponentState::Reconfiguring);
    assert!(!vol.in_old_layout(c(added)) && vol.in_new_layout(c(added)));
    assert!(vol.in_old_layout(c(dropped)) && !vol.in_new_layout(c(dropped)));
    assert_eq!(vol.total_votes(), 3, "the old layout's votes");
    // Both copies hold their space until the change ends.
    assert_eq!(s.devices[&devs[1]].reserved, SIZE);
    assert_eq!(s.devices[&devs[3]].reserved, SIZE);
    // A second change, a resize or a commit under another generation wait.
    assert!(begin_move(&mut s, &devs, v).is_err());
    let resize = Command::ResizeVolume {
        name: "v".into(),
        size: 2 * SIZE,
    };
    assert!(s.apply(&resize).is_err());
    let stale = commit(v, 7);
    assert!(matches!(
        s.apply(&stale),
        Err(StateError::GenerationConflict { .. })
    ));

    s.apply(&commit(v, 0)).unwrap();
    let vol = &s.volumes[&v];
    assert!(vol.reconfig.is_none());
    let nodes: Vec<_> = vol.components.iter().map(|c| (c.node, c.state)).collect();
    assert_eq!(
        nodes,
        vec![
            (1, ComponentState::Active),
            (3, ComponentState::Active),
            (4, ComponentState::Active)
        ]
    );
    assert_eq!(s.devices[&devs[1]].reserved, 0, "the dropped copy's space");
    assert_eq!(s.devices[&devs[3]].reserved, SIZE);
}

#[test]
fn an_abort_leaves_the_volume_as_it_was() {
    let (mut s, devs, v) = setup();
    let before = s.clone();
    begin_move(&mut s, &devs, v).unwrap();
    s.apply(&abort(v, 0)).unwrap();
    let mut expect = before;
    // Ids are never reused.
    expect.next_id = s.next_id;
    assert_eq!(s, expect);
    assert!(s.apply(&abort(v, 0)).is_err());
}

#[test]
fn the_votes_rule_holds_in_both_layouts_during_a_change() {
    let (mut s, devs, v) = setup();
    begin_move(&mut s, &devs, v).unwrap();
    let vol = s.volumes[&v].clone();
    let on = |nodes: &'static [u64]| move |c: &Component| nodes.contains(&c.node);
    let in_sync = |c: &Component| c.state == ComponentState::Active;
    // Old layout {1, 2, 3}, new layout {1, 3, 4}.
    assert!(vol.quorum(on(&[1, 3]), in_sync), "a majority of both");
    assert!(
        !vol.quorum(on(&[1, 2]), in_sync),
        "not a majority of the new layout"
    );
    assert!(
        !vol.quorum(on(&[1, 4]), in_sync),
        "not a majority of the old layout"
    );
    assert!(!vol.quorum(on(&[3, 4]), in_sync), "no in-sync copy");
}

#[test]
fn an_added_copy_the_owner_recorded_failed_is_not_committed() {
    let (mut s, devs, v) = setup();
    begin_move(&mut s, &devs, v).unwrap();
    let added = component_on(&s, v, 4);
    s.apply(&Command::SetComponentState {
        volume: v,
        component: added,
        state: ComponentState::Absent,
        generation: 0,
    })
    .unwrap();
    let commit = commit(v, 0);
    assert!(s.apply(&commit).is_err());
    s.apply(&abort(v, 0)).unwrap();
    assert_eq!(s.devices[&devs[3]].reserved, 0);
}

#[test]
fn space_is_checked_before_anything_changes() {
    let (mut s, devs, v) = setup();
    // Node 4's device is nearly full.
    s.apply(&Command::ReportDeviceUsage {
        device: devs[3],
        used: 4 * SIZE - 4096,
        state: shoal_model::DeviceState::Healthy,
    })
    .unwrap();
    let before = s.clone();
    assert!(matches!(
        begin_move(&mut s, &devs, v),
        Err(StateError::NoSpace { .. })
    ));
    assert_eq!(s, before);
    // A policy that reserves more for the kept copies is checked too.
    let (mut s, _devs, v) = setup();
    let grow = Command::BeginReconfig {
        volume: v,
        generation: 0,
        add: vec![],
        remove: vec![],
        policy: Some("raid1 ftt=1 reserve=100".parse().unwrap()),
        reason: "same".into(),
        wanted: None,
    };
    s.apply(&grow).unwrap();
}

#[test]
fn deleting_a_volume_mid_change_releases_all_of_its_space() {
    let (mut s, devs, _v) = setup();
    let v = s.volumes.keys().copied().next().unwrap();
    begin_move(&mut s, &devs, v).unwrap();
    s.apply(&Command::DeleteVolume { name: "v".into() })
        .unwrap();
    assert!(
        s.devices.values().all(|d| d.reserved == 0),
        "{:?}",
        s.devices
    );
}

#[test]
fn a_begin_names_existing_components_and_free_devices() {
    let (mut s, devs, v) = setup();
    let bad = |add: Vec<PlannedComponent>, remove: Vec<ComponentId>| Command::BeginReconfig {
        volume: v,
        generation: 0,
        add,
        remove,
        policy: None,
        reason: String::new(),
        wanted: None,
    };
    let before = s.clone();
    // Nothing to change; an unknown component; a device the volume uses;
    // a device twice; a device on another node; no data copy left.
    for cmd in [
        bad(vec![], vec![]),
        bad(vec![], vec![999]),
        bad(vec![planned(ComponentRole::Data, 1, devs[0])], vec![]),
        bad(
            vec![
                planned(ComponentRole::Data, 4, devs[3]),
                planned(ComponentRole::Witness, 4, devs[3]),
            ],
            vec![],
        ),
        bad(vec![planned(ComponentRole::Data, 4, devs[2])], vec![]),
        bad(vec![], vec![component_on(&s, v, 1), component_on(&s, v, 2)]),
    ] {
        assert!(s.apply(&cmd).is_err(), "{cmd:?} accepted");
        assert_eq!(s, before);
    }
}

/// A commit of the change in progress on `v`, naming no change.
fn commit(v: u64, generation: u64) -> Command {
    Command::CommitReconfig {
        volume: v,
        generation,
        added: vec![],
        remove: vec![],
    }
}

/// An abort of the change in progress on `v`, naming no change.
fn abort(v: u64, generation: u64) -> Command {
    Command::AbortReconfig {
        volume: v,
        generation,
        added: vec![],
        remove: vec![],
    }
}

/// The commit or abort of the change in progress on `v`, naming it.
fn end_named(s: &ClusterState, v: VolumeId, commit: bool) -> Command {
    let r = s.volumes[&v].reconfig.clone().unwrap();
    if commit {
        Command::CommitReconfig {
            volume: v,
            generation: 0,
            added: r.added,
            remove: r.remove,
        }
    } else {
        Command::AbortReconfig {
            volume: v,
            generation: 0,
            added: r.added,
            remove: r.remove,
        }
    }
}

#[test]
fn a_commit_or_abort_proposed_again_after_a_lost_answer_is_ok_and_changes_nothing() {
    for commit in [true, false] {
        let (mut s, devs, v) = setup();
        begin_move(&mut s, &devs, v).unwrap();
        let end = end_named(&s, v, commit);
        s.apply(&end).unwrap();
        let after = s.clone();
        s.apply(&end).unwrap();
        assert_eq!(s, after, "the second {end:?} changed the state");
        // The opposite end of the same change is refused: it did not happen.
        let opposite = match end {
            Command::CommitReconfig {
                volume,
                generation,
                added,
                remove,
            } => Command::AbortReconfig {
                volume,
                generation,
                added,
                remove,
            },
            Command::AbortReconfig {
                volume,
                generation,
                added,
                remove,
            } => Command::CommitReconfig {
                volume,
                generation,
                added,
                remove,
            },
            _ => unreachable!(),
        };
        assert!(s.apply(&opposite).is_err(), "{opposite:?} accepted");
    }
}

#[test]
fn an_end_naming_another_change_is_refused() {
    let (mut s, devs, v) = setup();
    begin_move(&mut s, &devs, v).unwrap();
    let other = Command::CommitReconfig {
        volume: v,
        generation: 0,
        added: vec![999],
        remove: vec![],
    };
    let before = s.clone();
    assert!(s.apply(&other).is_err());
    assert_eq!(s, before);
}

#[test]
fn a_policy_change_is_wanted_until_it_commits_or_the_policy_is_kept() {
    let (mut s, _, v) = setup();
    let ftt0: Policy = "raid1 ftt=0 reserve=100".parse().unwrap();
    let to_ftt0 = |s: &ClusterState| Command::BeginReconfig {
        volume: v,
        generation: 0,
        add: vec![],
        remove: vec![component_on(s, v, 2), component_on(s, v, 3)],
        policy: Some(ftt0),
        reason: "policy raid1 ftt=0".into(),
        wanted: None,
    };
    s.apply(&to_ftt0(&s)).unwrap();
    assert_eq!(s.volumes[&v].wanted_policy, Some(ftt0));
    // Aborted: still wanted (the caretaker begins it again).
    s.apply(&abort(v, 0)).unwrap();
    assert_eq!(s.volumes[&v].wanted_policy, Some(ftt0));
    assert_ne!(s.volumes[&v].policy, ftt0);
    // Kept: no longer wanted; again on a volume without one, no change.
    s.apply(&Command::KeepPolicy { volume: v }).unwrap();
    assert_eq!(s.volumes[&v].wanted_policy, None);
    s.apply(&Command::KeepPolicy { volume: v }).unwrap();
    assert!(matches!(
        s.apply(&Command::KeepPolicy { volume: 999 }),
        Err(StateError::NoSuchVolumeId(999))
    ));
    // Begun again and committed: the volume has it, nothing is wanted.
    s.apply(&to_ftt0(&s)).unwrap();
    s.apply(&commit(v, 0)).unwrap();
    assert_eq!(s.volumes[&v].policy, ftt0);
    assert_eq!(s.volumes[&v].wanted_policy, None);
}
