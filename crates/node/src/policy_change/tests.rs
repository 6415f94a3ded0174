use super::*;
use shoal_model::{ComponentRole, StripeGeometry, VolumeId};
use std::sync::Mutex;

fn pol(s: &str) -> Policy {
    s.parse().unwrap()
}

/// `n` nodes with a 1 GiB device each and volume "v" of 64 MiB under
/// `policy`, placed as `volume create` places it.
fn cluster(n: u64, policy: &str) -> (ClusterState, VolumeId) {
    let mut s = crate::testing::nodes(n);
    let policy = pol(policy);
    let nodes: Vec<_> = s.nodes.values().cloned().collect();
    let devices: Vec<_> = s.devices.values().cloned().collect();
    let components = shoal_placement::place(&policy, 64 << 20, &nodes, &devices)
        .unwrap()
        .into_iter()
        .map(|p| PlannedComponent {
            role: p.role,
            node: p.node,
            device: p.device,
            votes: p.votes,
        })
        .collect();
    let Response::Id(v) = s
        .apply(&Command::CreateVolume {
            name: "v".into(),
            size: 64 << 20,
            policy,
            wrapped_key: policy.encrypt.then(|| "key".to_string()),
            components,
        })
        .unwrap()
    else {
        panic!("no id");
    };
    (s, v)
}

/// The begin `plan` answers, or a panic.
fn begin(s: &ClusterState, policy: &str) -> Command {
    match plan(s, "v", &pol(policy)).unwrap() {
        Plan::Begin(cmd) => cmd,
        other => panic!("no begin: {other:?}"),
    }
}

/// Commits the change in progress on `v`, as its owner would.
fn commit(s: &mut ClusterState, v: VolumeId) {
    end(s, v, true);
}

/// Commits or aborts the change in progress on `v`.
fn end(s: &mut ClusterState, v: VolumeId, commit: bool) {
    let vol = &s.volumes[&v];
    let r = vol.reconfig.clone().expect("a change in progress");
    let (volume, generation, added, remove) = (v, vol.generation, r.added, r.remove);
    let cmd = match commit {
        true => Command::CommitReconfig {
            volume,
            generation,
            added,
            remove,
        },
        false => Command::AbortReconfig {
            volume,
            generation,
            added,
            remove,
        },
    };
    s.apply(&cmd).unwrap();
}

fn counts(s: &ClusterState, v: VolumeId) -> (usize, usize) {
    let cs = &s.volumes[&v].components;
    let data = cs.iter().filter(|c| c.role == ComponentRole::Data).count();
    (data, cs.len() - data)
}

#[test]
fn up_down_and_to_ftt0_and_back_each_apply_and_commit() {
    let (mut s, v) = cluster(5, "raid1 ftt=1");
    let cmd = begin(&s, "raid1 ftt=2");
    let Command::BeginReconfig {
        add,
        remove,
        policy,
        reason,
        generation,
        ..
    } = &cmd
    else {
        panic!("{cmd:?}");
    };
    assert_eq!(reason, "policy raid1 ftt=2");
    assert_eq!(*policy, Some(pol("raid1 ftt=2")));
    assert_eq!(*generation, s.volumes[&v].generation);
    assert!(remove.is_empty());
    let mut added: Vec<(u64, ComponentRole)> = add.iter().map(|a| (a.node, a.role)).collect();
    added.sort_by_key(|a| a.0);
    assert_eq!(
        added.iter().map(|a| a.0).collect::<Vec<_>>(),
        vec![4, 5],
        "the two unused nodes"
    );
    s.apply(&cmd).unwrap();
    // One change at a time.
    let e = plan(&s, "v", &pol("raid1 ftt=1")).unwrap_err();
    assert!(matches!(e, PolicyChangeError::InProgress { .. }), "{e}");
    assert_eq!(e.http_status(), 409);
    commit(&mut s, v);
    assert_eq!(counts(&s, v), (3, 2));
    assert_eq!(s.volumes[&v].policy.ftt, 2);
    for (policy, want) in [
        ("raid1 ftt=1", (2, 1)),
        ("ftt=0", (1, 0)),
        ("raid1 ftt=1", (2, 1)),
    ] {
        let cmd = begin(&s, policy);
        s.apply(&cmd).unwrap();
        commit(&mut s, v);
        assert_eq!(counts(&s, v), want, "{policy}");
        assert_eq!(s.volumes[&v].policy, pol(policy));
        let mut nodes: Vec<u64> = s.volumes[&v].components.iter().map(|c| c.node).collect();
        nodes.sort();
        nodes.dedup();
        assert_eq!(nodes.len(), want.0 + want.1, "distinct nodes");
    }
}

#[test]
fn the_same_policy_changes_nothing_and_other_words_change_only_the_policy() {
    let (s, _) = cluster(5, "raid1 ftt=1");
    assert_eq!(plan(&s, "v", &pol("raid1 ftt=1")), Ok(Plan::Unchanged));
    let Command::BeginReconfig { add, remove, .. } = begin(&s, "raid1 ftt=1 reserve=100 iops=50")
    else {
        panic!("not a begin");
    };
    assert!(add.is_empty() && remove.is_empty());
}

#[test]
fn asking_for_the_policy_a_volume_has_drops_a_wanted_change() {
    let (mut s, v) = cluster(5, "raid1 ftt=1");
    let cmd = begin(&s, "raid1 ftt=2");
    s.apply(&cmd).unwrap();
    let vol = &s.volumes[&v];
    let r = vol.reconfig.clone().unwrap();
    s.apply(&Command::AbortReconfig {
        volume: v,
        generation: vol.generation,
        added: r.added,
        remove: r.remove,
    })
    .unwrap();
    assert_eq!(s.volumes[&v].wanted_policy, Some(pol("raid1 ftt=2")));
    assert_eq!(
        plan(&s, "v", &pol("raid1 ftt=1")),
        Ok(Plan::Keep(Command::KeepPolicy { volume: v }))
    );
    // Asked again for the wanted one: a begin, as the first time.
    assert!(matches!(
        plan(&s, "v", &pol("raid1 ftt=2")),
        Ok(Plan::Begin(_))
    ));
}

#[test]
fn refusals_say_why() {
    let (mut s, _) = cluster(5, "raid1 ftt=1");
    let e = plan(&s, "v", &pol("raid1 ftt=3")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "cannot change volume v to raid1 ftt=3: raid1 ftt=3 needs 7 fault domains; the cluster has 5"
    );
    assert_eq!(e.http_status(), 409);
    let e = plan(&s, "w", &pol("raid1 ftt=2")).unwrap_err();
    assert_eq!(e, PolicyChangeError::NoSuchVolume("w".into()));
    assert_eq!(e.http_status(), 404);
    // A change of several steps whose end does not fit: refused before
    // the first step.
    let e = plan(&s, "v", &pol("raid6 ftt=2")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "cannot change volume v to raid6 ftt=2: raid6 ftt=2 needs 6 fault domains; the cluster \
         has 5"
    );
    assert_eq!(e.http_status(), 409);
    // Space: the new copy reserves the whole volume, and no device left
    // has it.
    for d in s.devices.values_mut().filter(|d| d.node >= 4) {
        d.used = d.capacity - (1 << 20);
    }
    let e = plan(&s, "v", &pol("raid1 ftt=2 reserve=100")).unwrap_err();
    assert!(e.to_string().contains("not enough space"), "{e}");
    // Encryption stays as it was.
    let e = plan(&s, "v", &pol("raid1 ftt=1 encrypt=on")).unwrap_err();
    assert_eq!(e.http_status(), 400);
    assert!(e.to_string().contains("cannot change"), "{e}");
    let (s, _) = cluster(5, "raid1 ftt=1 encrypt=on");
    let e = plan(&s, "v", &pol("raid1 ftt=2")).unwrap_err();
    assert!(e.to_string().contains("keep encrypt=on"), "{e}");
    assert!(matches!(
        plan(&s, "v", &pol("raid1 ftt=2 encrypt=on")),
        Ok(Plan::Begin(_))
    ));
    // A volume no owner can serve is left as it is.
    let (mut s, v) = cluster(5, "raid1 ftt=1");
    s.volumes.get_mut(&v).unwrap().problem = Some("copies refused".into());
    let e = plan(&s, "v", &pol("raid1 ftt=2")).unwrap_err();
    assert!(matches!(e, PolicyChangeError::Inaccessible { .. }), "{e}");
    assert_eq!(e.http_status(), 409);
}

#[test]
fn the_text_is_a_whole_policy_with_its_ftt() {
    assert_eq!(parse("raid1 ftt=2"), Ok(pol("raid1 ftt=2")));
    assert_eq!(parse("FTT=0,reserve=10"), Ok(pol("ftt=0 reserve=10")));
    for (text, want) in [
        ("raid1 ftt=2 fast=yes", "unknown policy word \"fast=yes\""),
        ("raid5 ftt=2", "raid5 tolerates exactly ftt=1"),
        ("raid1 ftt=4", "out of range"),
        ("checksum=off ftt=1", "checksum=off is not supported"),
        ("raid1 reserve=50", "add ftt=N"),
        ("", "unknown policy word"),
    ] {
        let e = parse(text).unwrap_err();
        assert!(e.to_string().contains(want), "{text:?}: {e}");
        assert_eq!(e.http_status(), 400, "{text:?}");
    }
}

/// A proposer over a state in a mutex: the first `conflicts` proposals
/// find the generation raised by the owner (as a resync raises it) and
/// are refused; later ones apply.
fn proposer(
    s: Arc<Mutex<ClusterState>>,
    conflicts: usize,
) -> impl Fn(Command) -> std::future::Ready<Result<Response, DirectoryError>> {
    let left = Mutex::new(conflicts);
    move |cmd| {
        let mut st = s.lock().unwrap();
        let mut left = left.lock().unwrap();
        if *left > 0 {
            *left -= 1;
            let Command::BeginReconfig { volume, .. } = &cmd else {
                panic!("{cmd:?}");
            };
            let g = st.volumes[volume].generation;
            st.apply(&Command::ClaimOwner {
                volume: *volume,
                node: 1,
                expected_generation: g,
            })
            .unwrap();
        }
        std::future::ready(st.apply(&cmd).map_err(DirectoryError::State))
    }
}

#[tokio::test]
async fn a_generation_moved_by_the_owner_is_planned_again_once() {
    let (s, v) = cluster(5, "raid1 ftt=1");
    let s = Arc::new(Mutex::new(s));
    let state = || Arc::new(s.lock().unwrap().clone());
    let r = change_with(state, proposer(s.clone(), 1), "v", &pol("raid1 ftt=2")).await;
    let Ok(Outcome::Begun { add, remove }) = r else {
        panic!("{r:?}");
    };
    assert_eq!((add.len(), remove.len()), (2, 0));
    assert!(s.lock().unwrap().volumes[&v].reconfig.is_some());
    // Twice: refused with why.
    let (s, _) = cluster(5, "raid1 ftt=1");
    let s = Arc::new(Mutex::new(s));
    let state = || Arc::new(s.lock().unwrap().clone());
    let r = change_with(state, proposer(s.clone(), 2), "v", &pol("raid1 ftt=2")).await;
    let e = r.unwrap_err();
    assert!(e.to_string().contains("generation conflict"), "{e}");
    assert_eq!(e.http_status(), 409);
    // The same policy: nothing proposed (a proposal would fail here).
    let r = change_with(
        state,
        |_| std::future::ready(Err(DirectoryError::NoLeader)),
        "v",
        &pol("raid1 ftt=1"),
    )
    .await;
    assert_eq!(r, Ok(Outcome::Unchanged));
}

#[tokio::test]
async fn a_begin_applied_twice_stands() {
    let (s, v) = cluster(5, "raid1 ftt=1");
    let s = Arc::new(Mutex::new(s));
    let state = || Arc::new(s.lock().unwrap().clone());
    // The first answer was lost: the proposal is applied, then applied
    // again and refused as a change in progress.
    let propose = |cmd: Command| {
        let mut st = s.lock().unwrap();
        st.apply(&cmd).unwrap();
        std::future::ready(st.apply(&cmd).map_err(DirectoryError::State))
    };
    let r = change_with(state, propose, "v", &pol("raid1 ftt=2")).await;
    assert!(matches!(r, Ok(Outcome::Begun { .. })), "{r:?}");
    assert!(s.lock().unwrap().volumes[&v].reconfig.is_some());
}

/// raid1 ftt=1 to raid5: the copies stay as the performance leg, the
/// change adds a capacity leg (2+1 on five hosts, 4+1 on six), and its
/// commit records the stripe geometry; raid1 ftt=2 to raid6 likewise.
#[test]
fn raid1_to_raid5_or_raid6_adds_a_capacity_leg() {
    for (hosts, from, to, geometry) in [
        (
            5,
            "raid1 ftt=1",
            "raid5 ftt=1",
            StripeGeometry::RAID5_NARROW,
        ),
        (6, "raid1 ftt=1", "raid5 ftt=1", StripeGeometry::RAID5_WIDE),
        (6, "raid1 ftt=2", "raid6 ftt=2", StripeGeometry::RAID6),
    ] {
        let (mut s, v) = cluster(hosts, from);
        let before = s.volumes[&v].components.clone();
        let cmd = begin(&s, to);
        let Command::BeginReconfig { add, remove, .. } = &cmd else {
            panic!("{cmd:?}");
        };
        assert!(remove.is_empty(), "{to}: {cmd:?}");
        assert_eq!(add.len(), geometry.width(), "{to}: {cmd:?}");
        assert!(add
            .iter()
            .all(|c| matches!(c.role, ComponentRole::Stripe { .. })));
        s.apply(&cmd).unwrap();
        commit(&mut s, v);
        let after = &s.volumes[&v];
        assert_eq!(after.stripe, Some(geometry), "{to}");
        assert_eq!(after.policy, pol(to));
        assert!(before.iter().all(|c| after.components.contains(c)), "{to}");
    }
}

/// The steps between every two policies: an erasure-coded volume is
/// lowered to RAID-1 of its ftt first, a RAID-1 volume changes ftt before
/// it gains a capacity leg; a change of the other words only is one step.
#[test]
fn changes_between_layouts_go_through_raid1_step_by_step() {
    let step = |a: &str, b: &str| next_step(&pol(a), &pol(b));
    assert_eq!(step("raid5 ftt=1", "raid6 ftt=2"), pol("raid1 ftt=1"));
    assert_eq!(step("raid1 ftt=1", "raid6 ftt=2"), pol("raid1 ftt=2"));
    assert_eq!(step("raid1 ftt=2", "raid6 ftt=2"), pol("raid6 ftt=2"));
    assert_eq!(step("raid6 ftt=2", "raid1 ftt=1"), pol("raid1 ftt=2"));
    assert_eq!(step("raid6 ftt=2", "raid5 ftt=1"), pol("raid1 ftt=2"));
    assert_eq!(step("raid1 ftt=2", "raid5 ftt=1"), pol("raid1 ftt=1"));
    assert_eq!(step("raid1 ftt=0", "raid5 ftt=1"), pol("raid1 ftt=1"));
    assert_eq!(step("raid5 ftt=1", "raid1 ftt=0"), pol("raid1 ftt=1"));
    assert_eq!(step("raid5 ftt=1", "raid1 ftt=3"), pol("raid1 ftt=1"));
    assert_eq!(step("raid1 ftt=3", "raid1 ftt=0"), pol("raid1 ftt=0"));
    // The other words travel with every step.
    assert_eq!(
        step("raid5 ftt=1", "raid6 ftt=2 iops=500"),
        pol("raid1 ftt=1 iops=500")
    );
    assert_eq!(
        step("raid5 ftt=1", "raid5 ftt=1 iops=500"),
        pol("raid5 ftt=1 iops=500")
    );
}

/// raid5 to raid6 on six hosts: the first step lowers the volume to
/// raid1 ftt=1 (every stripe column dropped, nothing added), wanting
/// raid6; its commit leaves a RAID-1 volume still wanting raid6, whose
/// next plan is the ftt change. On four hosts raid6 does not fit, and
/// nothing begins.
#[test]
fn raid5_to_raid6_lowers_first_and_keeps_wanting_raid6() {
    let (mut s, v) = cluster(6, "raid5 ftt=1");
    let columns: Vec<ComponentId> = s.volumes[&v]
        .components
        .iter()
        .filter(|c| matches!(c.role, ComponentRole::Stripe { .. }))
        .map(|c| c.id)
        .collect();
    let cmd = begin(&s, "raid6 ftt=2");
    let Command::BeginReconfig {
        add,
        remove,
        policy,
        wanted,
        ..
    } = &cmd
    else {
        panic!("{cmd:?}");
    };
    assert!(add.is_empty());
    assert_eq!(remove, &columns);
    assert_eq!(*policy, Some(pol("raid1 ftt=1")));
    assert_eq!(*wanted, Some(pol("raid6 ftt=2")));
    s.apply(&cmd).unwrap();
    assert_eq!(s.volumes[&v].wanted_policy, Some(pol("raid6 ftt=2")));
    commit(&mut s, v);
    let after = &s.volumes[&v];
    assert_eq!(after.policy, pol("raid1 ftt=1"));
    assert_eq!(after.stripe, None);
    assert_eq!(after.wanted_policy, Some(pol("raid6 ftt=2")));
    assert!(after.components.iter().all(|c| !columns.contains(&c.id)));
    // The next step: raid1 ftt=2, still wanting raid6; then raid6.
    let cmd = begin(&s, "raid6 ftt=2");
    assert!(
        matches!(&cmd, Command::BeginReconfig { policy: Some(p), .. } if *p == pol("raid1 ftt=2"))
    );
    s.apply(&cmd).unwrap();
    assert_eq!(s.volumes[&v].wanted_policy, Some(pol("raid6 ftt=2")));
    let (s4, _) = cluster(4, "raid5 ftt=1");
    let r = plan(&s4, "v", &pol("raid6 ftt=2"));
    assert!(
        matches!(
            r,
            Err(PolicyChangeError::Placement {
                error: PlacementError::NotEnoughFaultDomains {
                    needed: 6,
                    have: 4,
                    ..
                },
                ..
            })
        ),
        "{r:?}"
    );
    // A change of the other words only is one step, nothing moved.
    let (s, _) = cluster(4, "raid5 ftt=1");
    let cmd = begin(&s, "raid5 ftt=1 iops=500");
    assert!(
        matches!(&cmd, Command::BeginReconfig { add, remove, wanted: None, .. }
        if add.is_empty() && remove.is_empty())
    );
}

/// raid5 4+1 on six hosts with one host gone: a restripe to 2+1 is due.
/// Its first step lowers the volume to raid1 ftt=1 wanting raid5 back,
/// kept through the lowering's commit; the raise that follows places 2+1
/// on the five hosts up. With six up again, 4+1 is due; not while a node
/// is in maintenance, and nothing while a change is in progress.
#[test]
fn raid5_restripes_to_the_geometry_the_cluster_gives() {
    use shoal_model::{MaintenanceMode, NodeState};
    let (narrow, wide) = (StripeGeometry::RAID5_NARROW, StripeGeometry::RAID5_WIDE);
    let (mut s, v) = cluster(6, "raid5 ftt=1");
    assert_eq!(s.volumes[&v].stripe, Some(wide));
    assert_eq!(restripe_due(&s, &s.volumes[&v]), None);
    assert_eq!(plan_restripe(&s, "v", narrow).unwrap(), Plan::Unchanged);
    let gone = 6;
    s.nodes.get_mut(&gone).unwrap().state = NodeState::Down;
    assert_eq!(restripe_due(&s, &s.volumes[&v]), Some(narrow));
    // Asked for another geometry than the one due: nothing.
    assert_eq!(plan_restripe(&s, "v", wide).unwrap(), Plan::Unchanged);
    let Plan::Begin(cmd) = plan_restripe(&s, "v", narrow).unwrap() else {
        panic!("no restripe");
    };
    let Command::BeginReconfig {
        add,
        remove,
        policy,
        wanted,
        reason,
        ..
    } = &cmd
    else {
        panic!("{cmd:?}");
    };
    assert!(add.is_empty(), "{cmd:?}");
    assert_eq!(remove.len(), wide.width(), "{cmd:?}");
    assert_eq!(*policy, Some(pol("raid1 ftt=1")));
    assert_eq!(*wanted, Some(pol("raid5 ftt=1")));
    assert!(
        reason.starts_with("restripe 4+1 to 2+1 (5 fault domains): policy raid1 ftt=1"),
        "{reason}"
    );
    s.apply(&cmd).unwrap();
    let vol = &s.volumes[&v];
    assert_eq!(vol.wanted_policy, Some(pol("raid5 ftt=1")));
    assert_eq!(restripe_due(&s, vol), None, "a change is in progress");
    commit(&mut s, v);
    let vol = &s.volumes[&v];
    assert_eq!(
        (vol.policy, vol.wanted_policy, vol.stripe),
        (pol("raid1 ftt=1"), Some(pol("raid5 ftt=1")), None)
    );
    let cmd = begin(&s, "raid5 ftt=1");
    s.apply(&cmd).unwrap();
    commit(&mut s, v);
    let vol = &s.volumes[&v];
    assert_eq!((vol.stripe, vol.wanted_policy), (Some(narrow), None));
    assert!(vol
        .components
        .iter()
        .all(|c| c.node != gone || !matches!(c.role, ComponentRole::Stripe { .. })));
    s.nodes.get_mut(&gone).unwrap().state = NodeState::Up;
    assert_eq!(restripe_due(&s, &s.volumes[&v]), Some(wide));
    s.maintenance.insert(1, MaintenanceMode::NoDataMigration);
    assert_eq!(
        restripe_due(&s, &s.volumes[&v]),
        None,
        "a node in maintenance"
    );
}

/// A restripe that ends aborted leaves the volume wanting nothing: it
/// has its policy, and the restripe is asked again when due.
#[test]
fn an_aborted_restripe_wants_nothing() {
    use shoal_model::NodeState;
    let (mut s, v) = cluster(6, "raid5 ftt=1");
    s.nodes.get_mut(&6).unwrap().state = NodeState::Down;
    let Plan::Begin(cmd) = plan_restripe(&s, "v", StripeGeometry::RAID5_NARROW).unwrap() else {
        panic!("no restripe");
    };
    s.apply(&cmd).unwrap();
    end(&mut s, v, false);
    let vol = &s.volumes[&v];
    assert_eq!((vol.policy, vol.wanted_policy), (pol("raid5 ftt=1"), None));
    assert_eq!(restripe_due(&s, vol), Some(StripeGeometry::RAID5_NARROW));
}
