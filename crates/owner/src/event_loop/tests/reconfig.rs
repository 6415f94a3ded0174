//! A change of layout followed by the loop: adopted from a view, the added
//! copy brought in sync while it takes every write, committed (the dropped
//! copy retires) or aborted (the added one retires); and the rebuild of a
//! lost copy asked for after the repair delay, or at once for a failed
//! device.

use super::super::replica::{Layouts, Mode};
use super::super::resync::COPY_REGIONS_IN_FLIGHT;
use super::super::Flow;
use super::fakes::{answer, copy, fake_replica, rig, standard, write, FakeReplica, Rig, SIZE};
use crate::{ChangeEnd, Event, Target, View, REGION};
use bytes::Bytes;
use shoal_model::{Component, ComponentRole, ComponentState, Policy, Reconfig, Volume, BLOCK_SIZE};
use shoal_rpc::Request;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// Component 4, a data copy on node 4, added by a change.
const ADDED: u64 = 4;

/// The rig's volume as the directory has it (components 1 and 2 copies on
/// nodes 1 and 2, 3 a witness on node 3), with `extra` components and
/// change `reconfig`; node 4 (the added copy's) answers at `addr4`.
fn view(rig: &Rig, extra: &[Component], reconfig: Option<Reconfig>, addr4: &str) -> View {
    let comp = |id: u64, role, state| Component {
        id,
        role,
        node: id,
        device: 1,
        state,
        votes: 1,
    };
    let mut components = vec![
        comp(1, ComponentRole::Data, ComponentState::Active),
        comp(2, ComponentRole::Data, ComponentState::Active),
        comp(3, ComponentRole::Witness, ComponentState::Active),
    ];
    components.extend_from_slice(extra);
    let targets = components
        .iter()
        .map(|c| Target {
            component: c.clone(),
            addr: match rig.lp.replicas.get(c.id as usize - 1) {
                Some(r) if c.id < ADDED => r.addr.clone(),
                _ => addr4.to_string(),
            },
            node_up: true,
        })
        .collect();
    View {
        volume: Volume {
            id: 7,
            name: "v".into(),
            size: SIZE,
            policy: Policy::default(),
            components,
            owner: Some(1),
            generation: rig.lp.generation,
            problem: None,
            wrapped_key: None,
            reconfig,
            wanted_policy: None,
            grow_to: None,
            map_log_at: None,
            stripe: None,
        },
        targets,
        repair_delay: Duration::from_secs(3600),
        resync_bytes_per_s: None,
        previous_owner_gone: false,
    }
}

/// The change moving copy 2 to node 4, as begun in the directory.
fn move_copy_2(rig: &Rig, addr4: &str) -> View {
    let added = Component {
        id: ADDED,
        role: ComponentRole::Data,
        node: 4,
        device: 1,
        state: ComponentState::Reconfiguring,
        votes: 1,
    };
    let change = Reconfig {
        reason: "rebuild of component 2".into(),
        added: vec![ADDED],
        remove: vec![2],
        policy: None,
    };
    view(rig, &[added], Some(change), addr4)
}

/// A rig following the change that moves copy 2 to node 4, and node 4's
/// fake replica.
async fn moving() -> (Rig, Arc<FakeReplica>) {
    let mut rig = rig(&standard()).await;
    let (addr4, fake4) = fake_replica(4);
    rig.fakes[0].allocate(&[(0, 2 * REGION)]);
    let v = move_copy_2(&rig, &addr4);
    assert_eq!(rig.lp.apply(Event::View(Box::new(v))), Flow::Continue);
    rig.fakes.push(fake4.clone());
    (rig, fake4)
}

#[tokio::test]
async fn an_added_copy_is_synced_then_committed_and_the_dropped_copy_retires() {
    let (mut rig, fake4) = moving().await;
    let added = &rig.lp.replicas[3];
    assert_eq!(added.component, ADDED);
    assert!(added.layouts.added() && added.mode == Mode::Out);
    assert!(
        !rig.lp.replicas[1].layouts.new,
        "copy 2 leaves the new layout"
    );

    rig.tick();
    rig.run_until(|lp| lp.change.is_none()).await;

    assert_eq!(
        *rig.dir.ends.lock().unwrap(),
        vec![ChangeEnd {
            added: vec![ADDED],
            remove: vec![2],
            commit: true
        }]
    );
    // The added copy was recorded reconfiguring (as the commit wants it),
    // never active by the owner.
    assert_eq!(
        rig.dir.recorded(),
        vec![(ADDED, ComponentState::Reconfiguring)]
    );
    let sent = fake4.requests();
    for region in [0, 1] {
        assert!(
            sent.iter().any(
                |r| matches!(r, Request::Write { offset, seq: 0, .. } if *offset == region * REGION)
            ),
            "region {region} not copied: {sent:?}"
        );
    }
    assert_eq!(rig.lp.replicas[3].mode, Mode::InSync);
    assert_eq!(rig.lp.replicas[3].layouts, Layouts::BOTH);
    assert!(rig.lp.replicas[1].layouts.retired());
    assert_eq!(rig.lp.replicas[1].mode, Mode::Out);

    // Writes go to copies 1 and 4 only, and are acknowledged.
    let before2 = rig.requests(1).len();
    let ack = rig.submit(write(0, BLOCK_SIZE as usize, 9));
    rig.finish_write().await;
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
    assert_eq!(rig.requests(1).len(), before2, "a retired copy was written");
    assert!(matches!(
        fake4.requests().last(),
        Some(Request::WriteChecked { .. })
    ));
}

#[tokio::test]
async fn a_late_view_of_an_ended_change_is_not_adopted_again() {
    let (mut rig, _fake4) = moving().await;
    let addr4 = rig.lp.replicas[3].addr.clone();
    rig.tick();
    rig.run_until(|lp| lp.change.is_none()).await;
    let n = rig.lp.replicas.len();
    let stale = move_copy_2(&rig, &addr4);
    assert_eq!(rig.lp.apply(Event::View(Box::new(stale))), Flow::Continue);
    assert!(rig.lp.change.is_none());
    assert_eq!(rig.lp.replicas.len(), n);
}

#[tokio::test]
async fn writes_during_the_change_reach_the_added_copy_once_revived() {
    let (mut rig, fake4) = moving().await;
    rig.tick();
    rig.run_until(|lp| lp.replicas[3].mode == Mode::Resyncing)
        .await;
    let ack = rig.submit(write(3 * REGION, BLOCK_SIZE as usize, 5));
    rig.finish_write().await;
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
    assert!(
        fake4
            .requests()
            .iter()
            .any(|r| matches!(r, Request::WriteChecked { offset, .. } if *offset == 3 * REGION)),
        "the added copy missed a client write"
    );
    // Copy 2 (dropped at the commit) still takes writes until then.
    assert!(rig
        .requests(1)
        .iter()
        .any(|r| matches!(r, Request::WriteChecked { .. })));
}

/// Whether each change end proposed so far was a commit, in order.
fn commits(rig: &Rig) -> Vec<bool> {
    let ends = rig.dir.ends.lock().unwrap();
    ends.iter().map(|e| e.commit).collect()
}

#[tokio::test]
async fn a_refused_commit_aborts_and_the_added_copy_retires() {
    let (mut rig, _fake4) = moving().await;
    rig.dir.refuse_commit.store(true, Ordering::SeqCst);
    rig.tick();
    rig.run_until(|lp| lp.change.is_none()).await;
    let ends = commits(&rig);
    assert_eq!(ends, vec![true, false]);
    assert!(rig.lp.replicas[3].layouts.retired());
    assert_eq!(rig.lp.replicas[1].layouts, Layouts::BOTH);
    assert_eq!(rig.lp.replicas[1].mode, Mode::InSync);
}

#[tokio::test]
async fn an_added_copy_whose_host_goes_down_aborts_the_change() {
    let (mut rig, _fake4) = moving().await;
    let addr4 = rig.lp.replicas[3].addr.clone();
    let mut v = move_copy_2(&rig, &addr4);
    v.targets[3].node_up = false;
    assert_eq!(rig.lp.apply(Event::View(Box::new(v))), Flow::Continue);
    rig.tick();
    rig.run_until(|lp| lp.change.is_none()).await;
    let ends = commits(&rig);
    assert_eq!(ends, vec![false]);
    assert!(rig.lp.replicas[3].layouts.retired());
}

#[tokio::test]
async fn a_write_needs_a_majority_of_both_layouts() {
    // The change adds two copies and a witness (ftt=1 to ftt=2 in spirit):
    // the new layout has 6 votes, of which copy 1 and witness 3 are 2.
    let mut rig = rig(&standard()).await;
    let (addr, _f) = fake_replica(0);
    let c = |id, role| Component {
        id,
        role,
        node: id,
        device: 1,
        state: ComponentState::Reconfiguring,
        votes: 1,
    };
    let extra = [
        c(4, ComponentRole::Data),
        c(5, ComponentRole::Data),
        c(6, ComponentRole::Witness),
    ];
    let change = Reconfig {
        reason: "policy raid1 ftt=2".into(),
        added: vec![4, 5, 6],
        remove: vec![],
        policy: None,
    };
    let mut v = view(&rig, &extra, Some(change), &addr);
    for t in &mut v.targets[3..] {
        t.node_up = false;
    }
    assert_eq!(rig.lp.apply(Event::View(Box::new(v))), Flow::Continue);
    // Copy 2 fails the write: copy 1 and the witness hold 2 of 3 old
    // votes, but only 2 of 6 new ones.
    rig.fakes[1].answer_others(super::fakes::Answer::Err(shoal_rpc::RemoteError::Io(
        "bad".into(),
    )));
    let ack = rig.submit(write(0, BLOCK_SIZE as usize, 1));
    rig.finish_write().await;
    rig.run_until(|lp| lp.parked.is_empty()).await;
    assert!(
        matches!(answer(ack).await, Err(crate::OwnerError::Unavailable(e)) if e.contains("new one")),
        "a write acknowledged without a majority of the new layout"
    );
}

#[tokio::test]
async fn a_copy_on_a_dead_host_is_rebuilt_after_the_repair_delay() {
    let mut rig = rig(&super::returning()).await;
    rig.lp.replicas[1].node_up = false;
    rig.lp.repair_delay = Duration::from_secs(3600);
    rig.tick();
    assert!(rig.dir.rebuilds.lock().unwrap().is_empty(), "rebuilt early");
    rig.lp.repair_delay = Duration::ZERO;
    rig.tick();
    rig.run_until(|lp| !lp.rebuild.asking).await;
    assert_eq!(*rig.dir.rebuilds.lock().unwrap(), vec![vec![2]]);
}

#[tokio::test]
async fn a_copy_whose_device_failed_is_rebuilt_at_once_and_a_refusal_is_kept() {
    let mut rig = rig(&super::returning()).await;
    rig.lp.replicas[1].degraded = true;
    rig.lp.repair_delay = Duration::from_secs(3600);
    *rig.dir.refuse_rebuild.lock().unwrap() = Some("raid1 ftt=1 needs 3 fault domains".into());
    rig.tick();
    rig.run_until(|lp| !lp.rebuild.asking).await;
    assert_eq!(*rig.dir.rebuilds.lock().unwrap(), vec![vec![2]]);
    assert!(rig
        .lp
        .rebuild
        .problem
        .as_deref()
        .is_some_and(|p| p.contains("fault domains")));
    // Not asked again before the pause after a refusal.
    rig.tick();
    assert_eq!(rig.dir.rebuilds.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn a_static_rate_limit_spaces_the_copy_steps() {
    let mut rig = rig(&super::returning()).await;
    rig.fakes[0].allocate(&[(0, 3 * REGION)]);
    // 10 MiB/s: each 1 MiB region is due 100 ms after the one before.
    rig.lp.resync_bytes_per_s = Some(10 * REGION);
    let start = std::time::Instant::now();
    rig.tick();
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert_eq!(rig.lp.replicas[1].mode, Mode::InSync);
    assert!(
        start.elapsed() >= Duration::from_millis(200),
        "3 regions at 10 MiB/s copied in {:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn under_client_load_with_no_baseline_the_copy_pauses_to_measure_one() {
    use super::super::resync::ResyncPhase;
    use crate::pace::Pace;
    let copying =
        |lp: &super::super::Loop<super::fakes::FakeDir>| lp.resync.as_ref().map(|rs| rs.phase);
    // More regions than are copied at once.
    let regions = 2 * COPY_REGIONS_IN_FLIGHT as u64;
    let mut rig = super::fakes::rig_sized(&super::returning(), regions * REGION).await;
    rig.fakes[0].allocate(&[(0, regions * REGION)]);
    rig.tick();
    rig.run_until(|lp| copying(lp) == Some(ResyncPhase::Copying))
        .await;
    // Clients were busy during the copy's first tick: no baseline yet.
    for _ in 0..100 {
        rig.lp.latency.record(Duration::from_millis(2));
    }
    rig.tick();
    assert_eq!(rig.lp.adaptive.pace(), Pace::Pause);
    // The regions in flight end; no other starts while the probe runs.
    let started = COPY_REGIONS_IN_FLIGHT as u64 * REGION;
    rig.run_until(|lp| {
        lp.resync
            .as_ref()
            .is_some_and(|rs| rs.bytes_done == started)
    })
    .await;
    // The next region's turn comes (a tick later) and is put off again.
    assert_eq!(rig.step().await, Flow::Continue);
    let reads = |rig: &Rig| {
        let sent = rig.requests(0);
        sent.iter()
            .filter(|r| matches!(r, Request::Read { .. }))
            .count()
    };
    assert_eq!(
        reads(&rig),
        COPY_REGIONS_IN_FLIGHT,
        "the first regions copied, then the pause"
    );
    assert_eq!(copying(&rig.lp), Some(ResyncPhase::Copying));
    // The probe: clients alone are fast. The copy goes on, limited.
    for _ in 0..100 {
        rig.lp.latency.record(Duration::from_micros(200));
    }
    rig.tick();
    let resume = crate::pace::RESUME_BYTES_PER_S;
    assert_eq!(rig.lp.adaptive.pace(), Pace::Limit(resume));
    assert!(rig.lp.adaptive.baseline_us().is_some_and(|b| b < 300));
    // Limited for clients, the copy goes one region at a time.
    let most = std::cell::Cell::new(0);
    rig.run_until(|lp| {
        let now = lp.resync.as_ref().map_or(0, |rs| rs.in_flight.len());
        most.set(most.get().max(now));
        lp.resync.is_none()
    })
    .await;
    assert_eq!(most.get(), 1, "regions at once under a limited pace");
    assert_eq!(rig.lp.replicas[1].mode, Mode::InSync);
}

/// Whether `r` is a copy step of the reconciliation at `at`.
fn is_reconcile_write(r: &Request, at: u64) -> bool {
    matches!(r, Request::Write { offset, seq, .. } if *offset == at && *seq > 0)
}

#[tokio::test]
async fn regions_left_in_flight_are_reconciled_while_the_volume_serves() {
    // No copy on the owner's node: the source is the first in-sync copy.
    let mut rig = rig(&[
        copy(2, Mode::InSync, 2),
        copy(3, Mode::InSync, 3),
        super::fakes::witness(4),
    ])
    .await;
    // The source's reads hang: the reconciliation stays at its first
    // region, and a client read of a region not reconciled must wait for
    // the source too, never read the other copy.
    rig.fakes[0].answer_reads(super::fakes::Answer::Hang);
    rig.lp.start_reconcile([0, 2].into_iter().collect());
    let rc = rig.lp.reconcile.as_ref().expect("reconciling");
    assert_eq!((rc.source, rc.current), (0, Some(0)));
    let _pinned = rig.submit(crate::Op::Read {
        offset: 2 * REGION + 4096,
        len: 4096,
    });
    let _free = rig.submit(crate::Op::Read {
        offset: REGION,
        len: 4096,
    });
    rig.settle().await;
    let reads_of = |rig: &Rig, i: usize, at: u64| {
        rig.requests(i)
            .iter()
            .filter(|r| matches!(r, Request::Read { offset, .. } if *offset == at))
            .count()
    };
    assert_eq!(
        reads_of(&rig, 1, 2 * REGION + 4096),
        0,
        "read the other copy"
    );
    assert_eq!(reads_of(&rig, 0, 2 * REGION + 4096), 1);
    // A region not marked may be read from either copy.
    // No barrier while regions are left: it would clear the dead owner's
    // marks.
    rig.tick();
    assert!(!rig
        .requests(1)
        .iter()
        .any(|r| matches!(r, Request::Barrier { .. })));
}

#[tokio::test]
async fn a_reconciled_region_reaches_the_other_copies_then_a_barrier_follows() {
    let mut rig = rig(&standard()).await;
    rig.lp.start_reconcile([0, 3].into_iter().collect());
    assert_eq!(rig.lp.reconcile.as_ref().map(|rc| rc.source), Some(0));
    assert!(
        rig.route_published(),
        "the local copy is the source: reads stay local"
    );
    rig.run_until(|lp| lp.reconcile.is_none()).await;
    let sent = rig.requests(1);
    for at in [0, 3 * REGION] {
        assert!(
            sent.iter().any(|r| is_reconcile_write(r, at)),
            "region at {at} not copied: {sent:?}"
        );
    }
    assert!(!sent.iter().any(|r| is_reconcile_write(r, REGION)));
    rig.tick();
    assert!(rig
        .requests(1)
        .iter()
        .any(|r| matches!(r, Request::Barrier { .. })));
}

#[tokio::test]
async fn an_idle_owner_takes_out_a_copy_whose_node_is_down_only_if_it_does_not_answer() {
    let mut rig = rig(&standard()).await;
    rig.lp.replicas[1].node_up = false;
    // It still answers (the directory's word alone is not enough).
    rig.tick();
    rig.run_until(|lp| !lp.replicas[1].probing).await;
    assert_eq!(rig.lp.replicas[1].mode, Mode::InSync);
    // It stops answering: out, and recorded absent, with no I/O at all.
    rig.fakes[1].answer_others(super::fakes::Answer::Hang);
    rig.tick();
    rig.run_until(|lp| lp.replicas[1].mode == Mode::Out).await;
    assert_eq!(rig.dir.recorded(), vec![(2, ComponentState::Absent)]);
}
