//! Unit tests of the loop without sockets: each builds a [`super::Loop`]
//! over fake replicas ([`fakes`]), applies events one at a time (client
//! operations, the reports of the loop's own tasks, or synthetic ones), and
//! checks the answers, the requests the replicas received, and the loop's
//! state. Every `apply` also checks the invariants.

mod delta;
mod fakes;
mod reconfig;

use super::replica::{Mode, ReplicaSet};
use super::resync::{ResyncPhase, ReviveError, COPY_REGIONS_IN_FLIGHT};
use super::{Flow, Internal, RESYNC_RETRY_TICKS};
use crate::{ControlError, Event, Op, OwnerError, View, REGION};
use bytes::Bytes;
use fakes::{answer, answered, copy, rig, standard, witness, write, Answer, SIZE};
use shoal_model::{Component, ComponentState, Policy, Volume};
use shoal_rpc::{RemoteError, Request, RpcError};
use std::sync::atomic::Ordering;

fn stale() -> RemoteError {
    RemoteError::StaleGeneration { have: 2, got: 1 }
}

/// Copy 1 in sync on the owner's node (reads 5s), copy 2 out but up, a
/// witness: a tick starts resyncing copy 2.
fn returning() -> [fakes::Spec; 3] {
    [copy(1, Mode::InSync, 5), copy(2, Mode::Out, 0), witness(3)]
}

/// Copy 1 in sync but its connection lost (the last one in sync: the
/// owner keeps it and reconnects), copy 2 in sync, a witness.
fn lost_first() -> [fakes::Spec; 3] {
    [
        copy(1, Mode::InSync, 1).disconnected(),
        copy(2, Mode::InSync, 2),
        witness(3),
    ]
}

fn is_client_write(r: &Request, want: u64) -> bool {
    matches!(r, Request::WriteChecked { seq, .. } if *seq == want)
}

fn is_copy_write(r: &Request, at: u64) -> bool {
    matches!(r, Request::Write { offset, seq: 0, .. } if *offset == at)
}

#[tokio::test]
async fn a_write_reaches_every_copy_and_is_acked_once_all_answer() {
    let mut rig = rig(&standard()).await;
    let mut ack = rig.submit(write(0, 8192, 7));
    assert_eq!(
        rig.lp.inflight.get(&1),
        Some(&ReplicaSet::from_iter([0, 1]))
    );
    for i in 0..2 {
        let sent = rig.requests(i);
        assert!(
            matches!(sent.as_slice(), [Request::WriteChecked { seq: 1, offset: 0, crcs, generation: 1, .. }] if crcs.len() == 2),
            "copy {i} got {sent:?}"
        );
    }
    assert!(rig.requests(2).is_empty(), "a witness takes no data");
    assert_eq!(answered(&mut ack), None, "acked before the copies answered");

    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert_eq!(answered(&mut ack), Some(Ok(Bytes::new())));
    assert!(rig.lp.inflight.is_empty() && rig.lp.parked.is_empty());
    assert!(rig.dir.states.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_barrier_never_passes_a_write_in_flight() {
    let mut rig = rig(&standard()).await;
    rig.fakes[1].answer_others(Answer::Hang);
    let _first = rig.submit(write(0, 4096, 1));
    rig.fakes[1].answer_others(Answer::Ok);
    let mut second = rig.submit(write(4096, 4096, 2));
    // The second write finishes first; the first (seq 1) is still out.
    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert_eq!(answered(&mut second), Some(Ok(Bytes::new())));
    rig.tick();
    let barriers = |rig: &fakes::Rig| {
        rig.requests(0)
            .into_iter()
            .filter_map(|r| match r {
                Request::Barrier { seq, .. } => Some(seq),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert!(barriers(&rig).is_empty(), "barrier past write 1 in flight");
    // Write 1 times out on copy 2, which fails: no barrier passes it until
    // copy 2 is recorded out (an owner dying first would leave copy 2
    // recorded active, and write 1 must stay dirty on copy 1 for the next
    // one); then the barrier covers both writes.
    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert_eq!(rig.lp.replicas[1].mode, Mode::Failing);
    rig.tick();
    assert!(barriers(&rig).is_empty(), "barrier while copy 2 is failing");
    rig.run_until(|lp| lp.replicas[1].mode == Mode::Out).await;
    rig.tick();
    assert_eq!(barriers(&rig), vec![3]);
}

#[tokio::test]
async fn a_copy_failing_mid_write_is_marked_absent_before_the_ack() {
    let mut rig = rig(&standard()).await;
    rig.fakes[1].answer_others(Answer::Hang);
    let mut ack = rig.submit(write(0, 4096, 7));
    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert_eq!(rig.lp.replicas[1].mode, Mode::Failing);
    assert_eq!(rig.lp.parked.len(), 1);
    assert_eq!(
        answered(&mut ack),
        None,
        "acked before the copy that missed it is recorded"
    );

    let ev = rig.next_event().await;
    assert!(matches!(ev, Event::Internal(Internal::Marked { idx: 1 })));
    assert_eq!(rig.lp.apply(ev), Flow::Continue);
    assert_eq!(answered(&mut ack), Some(Ok(Bytes::new())));
    assert_eq!(
        *rig.dir.states.lock().unwrap(),
        vec![(2, ComponentState::Absent)]
    );
    assert_eq!(rig.lp.replicas[1].mode, Mode::Out);
    assert!(rig.lp.parked.is_empty());
}

#[tokio::test]
async fn a_write_that_skips_a_failing_copy_waits_for_its_record() {
    let mut rig = rig(&standard()).await;
    rig.fakes[1].answer_others(Answer::Hang);
    let first = rig.submit(write(0, 4096, 7));
    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert_eq!(rig.lp.replicas[1].mode, Mode::Failing);
    // Sent to copy 1 no more; it is not recorded absent yet.
    let mut second = rig.submit(write(4096, 4096, 8));
    assert_eq!(rig.lp.inflight.get(&2), Some(&ReplicaSet::one(0)));
    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert_eq!(
        answered(&mut second),
        None,
        "acked without a copy the directory may still have active"
    );
    rig.run_until(|lp| lp.replicas[1].mode == Mode::Out).await;
    assert_eq!(answer(first).await, Ok(Bytes::new()));
    assert_eq!(answer(second).await, Ok(Bytes::new()));
}

#[tokio::test]
async fn a_device_error_records_the_copy_degraded() {
    let mut rig = rig(&standard()).await;
    rig.fakes[1].answer_others(Answer::Err(RemoteError::Io("bad sector".into())));
    let ack = rig.submit(write(0, 4096, 7));
    rig.finish_write().await;
    rig.step().await;
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
    assert_eq!(
        *rig.dir.states.lock().unwrap(),
        vec![(2, ComponentState::Degraded)]
    );
    assert!(rig.lp.replicas[1].degraded);
}

#[tokio::test]
async fn a_copy_out_of_space_leaves_service_while_the_other_takes_the_write() {
    let mut rig = rig(&standard()).await;
    rig.fakes[1].answer_others(Answer::Err(RemoteError::NoSpace));
    let ack = rig.submit(write(0, 4096, 7));
    rig.finish_write().await;
    rig.step().await;
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
    assert_eq!(
        *rig.dir.states.lock().unwrap(),
        vec![(2, ComponentState::Degraded)]
    );
}

#[tokio::test]
async fn a_write_no_copy_has_space_for_fails_and_leaves_the_copies_in_service() {
    let mut rig = rig(&standard()).await;
    for f in &rig.fakes[..2] {
        f.answer_others(Answer::Err(RemoteError::NoSpace));
    }
    let ack = rig.submit(write(0, 4096, 7));
    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert_eq!(answer(ack).await, Err(OwnerError::NoSpace));
    assert!(rig.lp.replicas[..2].iter().all(|r| r.mode == Mode::InSync));
}

#[tokio::test]
async fn a_stale_generation_answer_deposes_the_owner() {
    let mut rig = rig(&standard()).await;
    assert!(rig.route_published());
    rig.fakes[1].answer_others(Answer::Err(stale()));
    let ack = rig.submit(write(0, 4096, 7));
    assert_eq!(rig.finish_write().await, Flow::Stop);
    assert_eq!(answer(ack).await, Err(OwnerError::Deposed));
    assert!(
        !rig.route_published(),
        "a deposed owner keeps no read route"
    );
}

#[tokio::test]
async fn a_stale_generation_on_reconnect_deposes_the_owner() {
    // The local copy lost its connection; when the tick reconnects it, it
    // has been activated by a newer owner.
    let mut rig = rig(&lost_first()).await;
    rig.fakes[0].answer_activations(Answer::Err(stale()));
    assert_eq!(rig.tick(), Flow::Continue);
    assert!(rig.lp.replicas[0].reconnecting);
    rig.run_until_stopped().await;
    assert!(rig
        .requests(0)
        .iter()
        .any(|r| matches!(r, Request::Activate { generation: 2, .. })));
}

#[tokio::test]
async fn a_lost_copy_is_reconnected_under_a_raised_generation_once_reachable() {
    // The last in-sync copy lost its connection (its frames of that
    // session may still be queued there). It is activated again only
    // after the generation is raised and the copy in service took it, so
    // a late frame of the old session is refused as stale.
    let mut rig = rig(&lost_first()).await;
    // While the copy's node does not answer, the directory is not asked.
    rig.lp.replicas[0].reconnecting = true;
    let refused = RpcError::Connect {
        addr: "x".into(),
        reason: "refused".into(),
    };
    let flow = rig.internal(Internal::LostReached {
        idx: 0,
        result: Err(refused),
    });
    assert_eq!(flow, Flow::Continue);
    assert!(!rig.lp.replicas[0].reconnecting);
    assert_eq!(rig.dir.generation.load(Ordering::SeqCst), 1);
    assert!(rig.requests(0).is_empty());

    // Reachable: raise, fence the copy in service, then activate.
    rig.tick();
    rig.run_until(|lp| lp.replicas[0].peer.is_some()).await;
    assert_eq!(rig.lp.generation, 2);
    assert_eq!(rig.dir.generation.load(Ordering::SeqCst), 2);
    assert!(
        matches!(
            rig.requests(0).as_slice(),
            [
                Request::CreateComponent { .. },
                Request::Activate { generation: 2, .. }
            ]
        ),
        "lost copy got {:?}",
        rig.requests(0)
    );
    assert!(
        rig.requests(1)
            .iter()
            .any(|r| matches!(r, Request::Flush { generation: 2, .. })),
        "the copy in service was not fenced: {:?}",
        rig.requests(1)
    );
    assert_eq!(rig.lp.replicas[0].mode, Mode::InSync);
    assert!(!rig.lp.reconnect_reclaim);
}

#[tokio::test]
async fn a_lost_copy_waits_while_a_failed_copy_is_being_recorded() {
    // A record made under generation 1 is in flight: raising now would
    // have the directory refuse it, so the reconnection waits for a tick.
    let mut rig = rig(&lost_first()).await;
    rig.lp.replicas[1].mode = Mode::Failing;
    rig.lp.replicas[1].peer = None;
    rig.lp.replicas[0].reconnecting = true;
    rig.internal(Internal::LostReached {
        idx: 0,
        result: Ok(()),
    });
    assert!(!rig.lp.reconnect_reclaim);
    assert!(!rig.lp.replicas[0].reconnecting);
    assert_eq!(rig.dir.generation.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_failed_reconnection_is_tried_again_later() {
    let mut rig = rig(&lost_first()).await;
    rig.lp.replicas[0].reconnecting = true;
    let refused = RpcError::Connect {
        addr: "x".into(),
        reason: "refused".into(),
    };
    let flow = rig.internal(Internal::Reconnected {
        idx: 0,
        peer: Err(refused),
    });
    assert_eq!(flow, Flow::Continue);
    assert!(!rig.lp.replicas[0].reconnecting);
    assert_eq!(rig.lp.replicas[0].mode, Mode::InSync);
    // The next tick reconnects it, and reads go to it directly again.
    assert!(!rig.route_published());
    rig.tick();
    rig.run_until(|lp| lp.replicas[0].peer.is_some()).await;
    assert!(rig.route_published());
}

#[tokio::test]
async fn a_witness_fenced_by_a_newer_owner_deposes_this_one() {
    let mut rig = rig(&standard()).await;
    rig.fakes[2].answer_others(Answer::Err(stale()));
    rig.tick();
    rig.run_until_stopped().await;
    assert!(matches!(
        rig.requests(2).last(),
        Some(Request::Flush { generation: 1, .. })
    ));
}

#[tokio::test]
async fn a_witness_that_stops_answering_no_longer_counts() {
    let mut rig = rig(&standard()).await;
    let flow = rig.internal(Internal::WitnessPing {
        idx: 2,
        result: Err(RpcError::Timeout(std::time::Duration::from_millis(1))),
    });
    assert_eq!(flow, Flow::Continue);
    assert!(!rig.lp.replicas[2].witness_ok);
    assert!(rig.lp.replicas[2].peer.is_none());
    // Two copies of three votes still take writes.
    let ack = rig.submit(write(0, 4096, 1));
    rig.finish_write().await;
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
}

fn count(requests: &[Request], what: fn(&Request) -> bool) -> usize {
    requests.iter().filter(|r| what(r)).count()
}

fn is_create(r: &Request) -> bool {
    matches!(r, Request::CreateComponent { .. })
}

fn is_flush(r: &Request) -> bool {
    matches!(r, Request::Flush { .. })
}

#[tokio::test]
async fn a_witness_ping_keeps_the_connection_it_made() {
    let specs = [
        copy(1, Mode::InSync, 1),
        copy(2, Mode::InSync, 2),
        witness(3).disconnected(),
    ];
    let mut rig = rig(&specs).await;
    for _ in 0..2 {
        rig.tick();
        let ev = rig.next_event().await;
        assert!(matches!(
            ev,
            Event::Internal(Internal::WitnessPing { idx: 2, .. })
        ));
        assert_eq!(rig.lp.apply(ev), Flow::Continue);
        assert!(rig.lp.replicas[2].witness_ok);
    }
    let sent = rig.requests(2);
    assert_eq!(count(&sent, is_flush), 2, "{sent:?}");
    assert_eq!(count(&sent, is_create), 1, "a new connection per ping");
    assert!(rig.lp.replicas[2].peer.is_some());
}

#[tokio::test]
async fn a_hung_witness_has_one_ping_at_a_time() {
    let mut rig = rig(&standard()).await;
    rig.fakes[2].answer_others(Answer::Hang);
    for _ in 0..3 {
        assert_eq!(rig.tick(), Flow::Continue);
    }
    rig.settle().await;
    assert_eq!(count(&rig.requests(2), is_flush), 1, "pings pile up");
    // The ping times out; the next tick sends another.
    let ev = rig.next_event().await;
    assert!(matches!(
        ev,
        Event::Internal(Internal::WitnessPing {
            idx: 2,
            result: Err(_)
        })
    ));
    assert_eq!(rig.lp.apply(ev), Flow::Continue);
    assert!(!rig.lp.replicas[2].witness_ok);
    rig.fakes[2].answer_others(Answer::Ok);
    rig.tick();
    rig.run_until(|lp| lp.replicas[2].witness_ok).await;
    assert_eq!(count(&rig.requests(2), is_flush), 2);
}

#[tokio::test]
async fn a_failed_read_is_retried_on_another_copy() {
    let mut rig = rig(&standard()).await;
    rig.fakes[0].answer_reads(Answer::Err(RemoteError::Io("bad sector".into())));
    let data = rig.submit(Op::Read {
        offset: 0,
        len: 4096,
    });
    let ev = rig.next_event().await;
    assert!(matches!(
        ev,
        Event::Internal(Internal::ReadFailed { idx: 0, .. })
    ));
    assert_eq!(rig.lp.apply(ev), Flow::Continue);
    assert_eq!(rig.lp.replicas[0].mode, Mode::Failing);
    assert!(
        !rig.route_published(),
        "reads still go to the failed local copy"
    );
    assert_eq!(answer(data).await, Ok(Bytes::from(vec![2u8; 4096])));
    assert!(matches!(
        rig.requests(1).last(),
        Some(Request::Read {
            offset: 0,
            len: 4096,
            ..
        })
    ));
}

#[tokio::test]
async fn a_bad_block_is_read_from_another_copy_and_repaired_in_place() {
    let mut rig = rig(&standard()).await;
    rig.fakes[0].answer_reads(Answer::Err(RemoteError::Checksum { offset: 8192 }));
    let data = rig.submit(Op::Read {
        offset: 8192,
        len: 4096,
    });
    rig.step().await;
    assert_eq!(answer(data).await, Ok(Bytes::from(vec![2u8; 4096])));
    assert_eq!(
        rig.lp.replicas[0].mode,
        Mode::InSync,
        "one bad block keeps the copy"
    );
    let ev = rig.next_event().await;
    assert!(matches!(
        ev,
        Event::Internal(Internal::Repaired {
            idx: 0,
            offset: 8192,
            result: Ok(true),
            ..
        })
    ));
    assert_eq!(rig.lp.apply(ev), Flow::Continue);
    assert!(rig
        .requests(0)
        .iter()
        .any(|r| matches!(r, Request::Repair { offset: 8192, .. })));
    assert!(rig.dir.states.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_scrubber_report_is_repaired_on_request() {
    let mut rig = rig(&standard()).await;
    let done = rig.submit(Op::Repair {
        component: 2,
        offset: 4096 + 17,
    });
    rig.step().await;
    assert_eq!(answer(done).await, Ok(Bytes::from_static(&[1])));
    assert!(rig
        .requests(1)
        .iter()
        .any(|r| matches!(r, Request::Repair { offset: 4096, .. })));
    let not_ours = rig.submit(Op::Repair {
        component: 3,
        offset: 0,
    });
    assert!(matches!(answer(not_ours).await, Err(OwnerError::Io(_))));
}

#[tokio::test]
async fn io_past_the_end_is_refused_without_touching_a_copy() {
    let mut rig = rig(&standard()).await;
    let read = rig.submit(Op::Read {
        offset: SIZE - 1,
        len: 2,
    });
    let wrote = rig.submit(write(SIZE, 4096, 1));
    let zeroed = rig.submit(Op::Zero {
        offset: u64::MAX,
        len: 2,
    });
    for a in [read, wrote, zeroed] {
        assert_eq!(answer(a).await, Err(OwnerError::OutOfRange));
    }
    assert!(rig.fakes.iter().all(|f| f.requests().is_empty()));
}

/// A trim of many ranges is one request to each copy, carrying them all
/// under the write numbering; ranges out of order or past the end are
/// refused without touching a copy.
#[tokio::test]
async fn a_trim_of_many_ranges_is_one_request_to_each_copy() {
    let mut rig = rig(&standard()).await;
    let ranges = vec![(0, 4096), (12288, 8192), (65536, 4096)];
    let bad = rig.submit(Op::Trim {
        ranges: vec![(8192, 4096), (0, 4096)],
    });
    assert!(matches!(answer(bad).await, Err(OwnerError::Invalid(_))));
    let past = rig.submit(Op::Trim {
        ranges: vec![(0, 4096), (SIZE, 4096)],
    });
    assert_eq!(answer(past).await, Err(OwnerError::OutOfRange));
    assert!(rig.fakes.iter().all(|f| f.requests().is_empty()));
    let done = rig.submit(Op::Trim {
        ranges: ranges.clone(),
    });
    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert_eq!(answer(done).await, Ok(Bytes::new()));
    for i in 0..2 {
        let sent: Vec<Request> = rig.requests(i);
        assert!(
            matches!(&sent[..], [Request::TrimRanges { ranges: r, seq, .. }] if *r == ranges && *seq > 0),
            "{sent:?}"
        );
    }
}

#[tokio::test]
async fn the_last_in_sync_copy_is_never_marked_absent() {
    let mut rig = rig(&returning()).await;
    rig.fakes[0].answer_others(Answer::Hang);
    let ack = rig.submit(write(0, 4096, 1));
    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert!(matches!(answer(ack).await, Err(OwnerError::Unavailable(_))));
    let r = &rig.lp.replicas[0];
    assert_eq!(r.mode, Mode::InSync);
    assert!(r.peer.is_none());
    assert!(rig.lp.parked.is_empty());
    assert!(rig.dir.states.lock().unwrap().is_empty());
    assert!(!rig.route_published());
}

#[tokio::test]
async fn a_newer_owner_in_the_view_stops_the_loop() {
    let mut rig = rig(&standard()).await;
    let mut volume = Volume {
        id: 7,
        name: "v".into(),
        size: SIZE,
        policy: Policy::default(),
        components: Vec::<Component>::new(),
        owner: Some(9),
        generation: 1,
        problem: None,
        wrapped_key: None,
        reconfig: None,
        wanted_policy: None,
        grow_to: None,
        map_log_at: None,
        stripe: None,
    };
    assert_eq!(
        rig.lp.apply(Event::View(Box::new(View {
            volume: volume.clone(),
            targets: vec![],
            repair_delay: crate::DEFAULT_REPAIR_DELAY,
            resync_bytes_per_s: None,
            previous_owner_gone: false,
        }))),
        Flow::Continue
    );
    volume.generation = 2;
    let view = View {
        volume,
        targets: vec![],
        repair_delay: crate::DEFAULT_REPAIR_DELAY,
        resync_bytes_per_s: None,
        previous_owner_gone: false,
    };
    assert_eq!(rig.lp.apply(Event::View(Box::new(view))), Flow::Continue);
    assert!(matches!(rig.next_event().await, Event::Stop));
    assert_eq!(rig.lp.apply(Event::Stop), Flow::Stop);
    assert!(!rig.route_published());
}

#[tokio::test]
async fn a_returning_copy_is_resynced_and_rejoins() {
    let mut rig = rig(&returning()).await;
    // Regions 0 and 1 allocated on the source, region 3 on the target.
    rig.fakes[0].allocate(&[(0, REGION + 1)]);
    rig.fakes[1].allocate(&[(3 * REGION, 10)]);
    rig.tick();
    assert!(matches!(
        rig.lp.resync.as_ref().map(|rs| rs.phase),
        Some(ResyncPhase::Reclaiming)
    ));
    rig.run_until(|lp| lp.resync.is_none()).await;

    assert_eq!(rig.lp.replicas[1].mode, Mode::InSync);
    assert_eq!(rig.lp.generation, 2, "resync fences with a new generation");
    assert_eq!(rig.dir.generation.load(Ordering::SeqCst), 2);
    assert_eq!(
        *rig.dir.states.lock().unwrap(),
        vec![(2, ComponentState::Resyncing), (2, ComponentState::Active)]
    );
    let sent = rig.requests(1);
    assert!(matches!(
        sent.first(),
        Some(Request::CreateComponent { .. })
    ));
    assert!(sent
        .iter()
        .any(|r| matches!(r, Request::Activate { generation: 2, .. })));
    for region in [0, 1, 3] {
        assert!(
            sent.iter().any(|r| is_copy_write(r, region * REGION)),
            "region {region} not copied: {sent:?}"
        );
    }
    assert!(!sent.iter().any(|r| is_copy_write(r, 2 * REGION)));
    // Back in service: writes reach it.
    let ack = rig.submit(write(0, 4096, 9));
    rig.finish_write().await;
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
    assert!(is_client_write(rig.requests(1).last().unwrap(), 1));
}

#[tokio::test]
async fn copies_in_service_adopt_a_reclaimed_generation_before_reads_under_it() {
    let mut rig = rig(&returning()).await;
    rig.fakes[0].allocate(&[(0, REGION)]);
    rig.tick();
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert_eq!(rig.lp.replicas[1].mode, Mode::InSync);
    // A replica refuses a read under a generation it has not taken.
    let sent = rig.requests(0);
    let fenced = sent
        .iter()
        .position(|r| matches!(r, Request::Flush { generation: 2, .. }));
    let read = sent
        .iter()
        .position(|r| matches!(r, Request::Read { generation: 2, .. }));
    assert!(
        matches!((fenced, read), (Some(f), Some(r)) if f < r),
        "{sent:?}"
    );
}

#[tokio::test]
async fn a_write_to_the_region_being_copied_waits_for_the_copy_step() {
    let mut rig = rig(&returning()).await;
    rig.fakes[0].allocate(&[(0, 2 * REGION)]);
    rig.tick();
    rig.run_until(|lp| lp.locks.contains(&(0, REGION))).await;
    let ack = rig.submit(write(4096, 4096, 9));
    assert_eq!(rig.lp.blocked.len(), 1);
    assert!(!rig.requests(0).iter().any(|r| is_client_write(r, 1)));

    rig.run_until(|lp| lp.blocked.is_empty()).await;
    // The region's copy is queued before the write on the resyncing copy,
    // so the write is not overwritten by older data.
    let sent = rig.requests(1);
    let copied = sent.iter().position(|r| is_copy_write(r, 0));
    let written = sent.iter().position(|r| is_client_write(r, 1));
    assert!(
        matches!((copied, written), (Some(c), Some(w)) if c < w),
        "{sent:?}"
    );
    assert!(rig.requests(0).iter().any(|r| is_client_write(r, 1)));
    rig.finish_write().await;
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
}

/// Regions are copied [`COPY_REGIONS_IN_FLIGHT`] at once, each read from
/// the in-sync copies in turn, each locked only while it is read.
#[tokio::test]
async fn a_resync_copies_regions_in_parallel_from_every_in_sync_copy() {
    let specs = [
        copy(1, Mode::InSync, 5),
        copy(2, Mode::InSync, 5),
        copy(3, Mode::Out, 0),
    ];
    let mut rig = fakes::rig_sized(&specs, 8 * REGION).await;
    rig.fakes[0].allocate(&[(0, 8 * REGION)]);
    rig.tick();
    rig.run_until(|lp| {
        lp.resync
            .as_ref()
            .is_some_and(|rs| rs.in_flight.len() == COPY_REGIONS_IN_FLIGHT)
    })
    .await;
    assert_eq!(rig.lp.locks.len(), COPY_REGIONS_IN_FLIGHT);
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert_eq!(rig.lp.replicas[2].mode, Mode::InSync);
    assert!(rig.lp.locks.is_empty());
    let reads = |i: usize| -> Vec<u64> {
        let mut v: Vec<u64> = rig
            .requests(i)
            .iter()
            .filter_map(|r| match r {
                Request::Read { offset, len, .. } if *len as u64 == REGION => Some(offset / REGION),
                _ => None,
            })
            .collect();
        v.sort_unstable();
        v
    };
    assert_eq!(reads(0), vec![0, 2, 4, 6]);
    assert_eq!(reads(1), vec![1, 3, 5, 7]);
    let copied = (0..8)
        .filter(|r| rig.requests(2).iter().any(|q| is_copy_write(q, r * REGION)))
        .count();
    assert_eq!(copied, 8);
}

#[tokio::test]
async fn a_failed_copy_read_releases_the_region_lock() {
    // The source is the only in-sync copy: a failed read keeps it in
    // service, and must still end the attempt and free the region.
    let mut rig = rig(&returning()).await;
    rig.fakes[0].allocate(&[(0, REGION)]);
    rig.fakes[0].answer_reads(Answer::Err(RemoteError::Io("bad sector".into())));
    rig.tick();
    rig.run_until(|lp| !lp.locks.is_empty()).await;
    let ack = rig.submit(write(0, 4096, 9));
    assert_eq!(rig.lp.blocked.len(), 1);
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert!(rig.lp.locks.is_empty());
    assert!(rig.lp.blocked.is_empty());
    assert_eq!(rig.lp.replicas[1].mode, Mode::Out);
    assert_eq!(rig.lp.resync_backoff, RESYNC_RETRY_TICKS);
    // Answered, not left waiting: the source lost its connection.
    assert!(matches!(answer(ack).await, Err(OwnerError::Unavailable(_))));
}

#[tokio::test]
async fn a_late_report_of_an_aborted_resync_is_ignored() {
    let mut rig = rig(&returning()).await;
    rig.fakes[0].allocate(&[(0, REGION)]);
    rig.tick();
    rig.run_until(|lp| !lp.locks.is_empty()).await;
    let first = rig.lp.resync_attempts;
    rig.lp.abort_resync();
    rig.lp.check_invariants(Flow::Continue);
    rig.lp.resync_backoff = 0;
    rig.tick();
    assert_eq!(rig.lp.resync_attempts, first + 1);
    // The first attempt's copy step and completion arrive late.
    for late in [
        Internal::CopyWritten {
            attempt: first,
            region: 0,
            result: Ok(REGION),
        },
        Internal::ResyncDone {
            attempt: first,
            generation: rig.lp.generation,
            result: Ok(()),
        },
    ] {
        assert_eq!(rig.internal(late), Flow::Continue);
        let rs = rig.lp.resync.as_ref().expect("second attempt goes on");
        assert_eq!(rs.attempt, first + 1);
        assert_eq!(rs.phase, ResyncPhase::Reclaiming);
        assert_eq!(rig.lp.replicas[1].mode, Mode::Out);
    }
    // The second attempt completes, its events mixed with the first's.
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert_eq!(rig.lp.replicas[1].mode, Mode::InSync);
    // A conflict under the current generation deposes the owner
    // whichever attempt it answers.
    let conflict = Internal::ResyncDone {
        attempt: first,
        generation: rig.lp.generation,
        result: Err(ControlError::Conflict),
    };
    assert_eq!(rig.internal(conflict), Flow::Stop);
}

#[tokio::test]
async fn a_resync_the_directory_refuses_deposes_the_owner() {
    let mut rig = rig(&returning()).await;
    rig.dir.conflict.store(true, Ordering::SeqCst);
    rig.tick();
    rig.run_until_stopped().await;
    assert_eq!(rig.lp.replicas[1].mode, Mode::Out);
}

#[tokio::test]
async fn a_conflict_recording_the_copy_resyncing_deposes_the_owner() {
    let mut rig = rig(&returning()).await;
    rig.tick();
    // Reclaimed: the revival is under way, under generation 2.
    rig.run_until(|lp| lp.generation == 2).await;
    rig.dir.conflict.store(true, Ordering::SeqCst);
    let revived = loop {
        match rig.next_event().await {
            ev @ Event::Internal(Internal::Revived { .. }) => break ev,
            other => assert_eq!(rig.lp.apply(other), Flow::Continue),
        }
    };
    assert!(matches!(
        revived,
        Event::Internal(Internal::Revived {
            peer: Err(ReviveError::Record(ControlError::Conflict)),
            ..
        })
    ));
    assert_eq!(rig.lp.apply(revived), Flow::Stop);
}

/// A rig whose resync of its one copy out reached its last phase: the
/// directory holds the request to record that copy active.
async fn finishing(specs: &[fakes::Spec]) -> fakes::Rig {
    let mut rig = rig(specs).await;
    rig.fakes[0].allocate(&[(0, REGION)]);
    rig.dir.hold_active.store(true, Ordering::SeqCst);
    rig.tick();
    rig.run_until(|lp| {
        lp.resync
            .as_ref()
            .is_some_and(|rs| rs.phase == ResyncPhase::Finishing)
    })
    .await;
    rig
}

fn recorded_before(rig: &fakes::Rig, first: (u64, ComponentState), then: (u64, ComponentState)) {
    let states = rig.dir.recorded();
    let at = |s| states.iter().position(|&x| x == s);
    assert!(
        matches!((at(first), at(then)), (Some(a), Some(b)) if a < b),
        "{first:?} not recorded before {then:?}: {states:?}"
    );
}

#[tokio::test]
async fn a_target_failing_while_recorded_active_is_recorded_degraded_after() {
    let mut rig = finishing(&returning()).await;
    rig.fakes[1].answer_others(Answer::Err(RemoteError::Io("dead disk".into())));
    let mut ack = rig.submit(write(0, 4096, 9));
    assert_eq!(rig.finish_write().await, Flow::Continue);
    assert_eq!(rig.lp.replicas[1].mode, Mode::Failing);
    rig.settle().await;
    assert_eq!(
        rig.dir.recorded(),
        vec![(2, ComponentState::Resyncing)],
        "recorded degraded while the request to record it active is in flight"
    );
    assert_eq!(answered(&mut ack), None);
    rig.dir.answer_active();
    let ev = rig.next_event().await;
    assert!(matches!(
        ev,
        Event::Internal(Internal::ResyncDone { result: Ok(()), .. })
    ));
    assert_eq!(rig.lp.apply(ev), Flow::Continue);
    assert_eq!(rig.lp.replicas[1].mode, Mode::Failing);
    assert_eq!(answered(&mut ack), None);
    rig.run_until(|lp| lp.replicas[1].mode == Mode::Out).await;
    assert_eq!(
        rig.dir.recorded(),
        vec![
            (2, ComponentState::Resyncing),
            (2, ComponentState::Active),
            (2, ComponentState::Degraded)
        ]
    );
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
}

#[tokio::test]
async fn a_write_waits_for_a_target_abandoned_while_recorded_active() {
    // Three copies in sync (the first one is the source), the fourth
    // being resynced, a witness.
    let specs = [
        copy(1, Mode::InSync, 5),
        copy(2, Mode::InSync, 6),
        copy(3, Mode::InSync, 7),
        copy(4, Mode::Out, 0),
        witness(5),
    ];
    let mut rig = finishing(&specs).await;
    // The source fails: the attempt is given up.
    rig.fakes[0].answer_reads(Answer::Err(RemoteError::Io("bad sector".into())));
    let data = rig.submit(Op::Read {
        offset: 0,
        len: 4096,
    });
    let ev = rig.next_event().await;
    assert!(matches!(
        ev,
        Event::Internal(Internal::ReadFailed { idx: 0, .. })
    ));
    assert_eq!(rig.lp.apply(ev), Flow::Continue);
    assert!(rig.lp.resync.is_none());
    assert!(answer(data).await.is_ok());
    // A write that skips the target waits until it is recorded absent,
    // which waits until the request to record it active answered.
    let mut ack = rig.submit(write(0, 4096, 9));
    assert_eq!(rig.finish_write().await, Flow::Continue);
    rig.run_until(|lp| lp.replicas[0].mode == Mode::Out).await;
    rig.settle().await;
    assert_eq!(
        answered(&mut ack),
        None,
        "acknowledged without the target while it may be recorded active"
    );
    assert_eq!(rig.lp.replicas[3].mode, Mode::Failing);
    assert!(!rig.dir.recorded().contains(&(4, ComponentState::Absent)));
    rig.dir.answer_active();
    rig.run_until(|lp| lp.replicas[3].mode == Mode::Out).await;
    recorded_before(
        &rig,
        (4, ComponentState::Active),
        (4, ComponentState::Absent),
    );
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
}

#[tokio::test]
async fn parked_writes_are_answered_deposed_when_the_loop_ends() {
    let mut rig = rig(&standard()).await;
    rig.dir.conflict.store(true, Ordering::SeqCst);
    rig.fakes[1].answer_others(Answer::Hang);
    let ack = rig.submit(write(0, 4096, 1));
    rig.finish_write().await;
    assert_eq!(rig.lp.parked.len(), 1);
    // The directory refuses the mark: another owner took over.
    let ev = rig.next_event().await;
    assert!(matches!(
        ev,
        Event::Internal(Internal::RecordConflict { generation: 1, .. })
    ));
    assert_eq!(rig.lp.apply(ev), Flow::Stop);
    rig.lp.shutdown();
    assert_eq!(answer(ack).await, Err(OwnerError::Deposed));
}

#[test]
fn replica_sets_list_their_members_in_order() {
    let s = ReplicaSet::from_iter([5, 0, 63, 2]);
    assert_eq!(s.iter().collect::<Vec<_>>(), vec![0, 2, 5, 63]);
    assert_eq!((s.len(), s.nth(2), s.nth(4)), (4, Some(5), None));
    assert!(s.contains(63) && !s.contains(1) && !s.contains(64));
    assert!(ReplicaSet::one(2).is_subset(s) && !s.is_subset(ReplicaSet::below(63)));
    assert_eq!(ReplicaSet::below(64).len(), 64);
    assert!(ReplicaSet::EMPTY.is_empty() && !s.intersects(ReplicaSet::one(1)));
}

// The checks catch a broken state, even on the event that stops the loop.

#[tokio::test]
#[should_panic(expected = "region lock held by neither")]
async fn a_region_lock_without_a_resync_is_caught() {
    let mut rig = rig(&standard()).await;
    rig.lp.locks = vec![(0, REGION)];
    rig.lp.apply(Event::Stop);
}

#[tokio::test]
#[should_panic(expected = "resyncing outside the resync")]
async fn a_copy_resyncing_outside_a_resync_is_caught() {
    let mut rig = rig(&standard()).await;
    rig.lp.replicas[1].mode = Mode::Resyncing;
    rig.lp.check_invariants(Flow::Continue);
}

#[tokio::test]
#[should_panic(expected = "not the local in-sync copy")]
async fn a_read_route_to_a_copy_out_of_sync_is_caught() {
    let mut rig = rig(&standard()).await;
    rig.lp.replicas[0].mode = Mode::Out;
    rig.lp.check_invariants(Flow::Continue);
}

#[tokio::test]
#[should_panic(expected = "writes parked with no copy being recorded")]
async fn a_write_parked_on_no_failing_copy_is_caught() {
    let mut rig = rig(&standard()).await;
    let (reply, _rx) = tokio::sync::oneshot::channel();
    rig.lp.parked.push(super::io::Parked {
        waiting: ReplicaSet::one(1),
        ok: ReplicaSet::one(0),
        reply,
        since: std::time::Instant::now(),
    });
    rig.lp.check_invariants(Flow::Continue);
}

#[tokio::test]
#[should_panic(expected = "abandoned finishing copy 1 is not failing")]
async fn an_abandoned_finishing_copy_out_of_service_is_caught() {
    let mut rig = rig(&returning()).await;
    rig.lp.resync_attempts = 1;
    rig.lp.abandoned = Some(super::resync::Abandoned {
        attempt: 1,
        idx: 1,
        state: ComponentState::Absent,
    });
    rig.lp.check_invariants(Flow::Continue);
}

#[tokio::test]
#[should_panic(expected = "in-flight writes and their futures differ")]
async fn a_write_in_flight_without_its_future_is_caught() {
    let mut rig = rig(&standard()).await;
    rig.lp.inflight.insert(1, ReplicaSet::one(0));
    rig.lp.next_seq = 2;
    rig.lp.check_invariants(Flow::Continue);
}

fn renewed(outcome: super::lease::Renewal, generation: u64) -> Internal {
    Internal::Renewed {
        sent: std::time::Instant::now(),
        generation,
        outcome,
    }
}

#[tokio::test]
async fn a_read_without_a_lease_waits_for_a_renewal_by_a_majority() {
    use super::lease::Renewal;
    let mut rig = rig(&standard()).await;
    rig.lp.lease.end();
    let mut read = rig.submit(Op::Read {
        offset: 0,
        len: 4096,
    });
    assert_eq!(rig.lp.lease_waiting.len(), 1, "the read waits");
    assert!(rig.lp.renewing, "and a renewal asks for the lease");
    rig.settle().await;
    assert!(
        rig.fakes.iter().all(|f| matches!(
            f.requests().last(),
            Some(Request::Renew { generation: 1, .. })
        )),
        "every component is asked"
    );
    assert!(
        rig.requests(0)
            .iter()
            .all(|r| !matches!(r, Request::Read { .. })),
        "nothing read without a lease"
    );
    // A round without a majority changes nothing; one with a majority
    // serves the read.
    assert_eq!(rig.internal(renewed(Renewal::NoQuorum, 1)), Flow::Continue);
    assert_eq!(answered(&mut read), None);
    assert_eq!(rig.internal(renewed(Renewal::Quorum, 1)), Flow::Continue);
    assert!(rig.lp.lease_waiting.is_empty());
    assert_eq!(answer(read).await, Ok(Bytes::from(vec![1u8; 4096])));
}

#[tokio::test]
async fn a_read_that_waits_too_long_for_a_lease_fails_and_a_newer_owner_deposes() {
    use super::lease::Renewal;
    let mut rig = rig(&standard()).await;
    rig.lp.lease.end();
    let read = rig.submit(Op::Read {
        offset: 0,
        len: 4096,
    });
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    assert_eq!(rig.tick(), Flow::Continue);
    assert!(matches!(
        answer(read).await,
        Err(OwnerError::Unavailable(_))
    ));
    // A stale answer to a round of an older generation of this owner is
    // not a deposition; one of the current generation is.
    rig.lp.renewing = true;
    assert_eq!(rig.internal(renewed(Renewal::Stale, 0)), Flow::Continue);
    rig.lp.renewing = true;
    assert_eq!(rig.internal(renewed(Renewal::Stale, 1)), Flow::Stop);
}

#[tokio::test]
async fn a_record_refused_under_a_generation_this_owner_raised_since_is_made_again() {
    let mut rig = rig(&standard()).await;
    rig.fakes[1].answer_others(Answer::Hang);
    let ack = rig.submit(write(0, 4096, 1));
    rig.finish_write().await;
    assert_eq!(rig.lp.replicas[1].mode, Mode::Failing);
    // This owner raised the generation meanwhile (a reconnection): the
    // record made under 1 comes back refused.
    rig.dir.generation.store(2, Ordering::SeqCst);
    rig.lp.generation = 2;
    let flow = rig.internal(Internal::RecordConflict {
        idx: 1,
        state: ComponentState::Absent,
        generation: 1,
    });
    assert_eq!(flow, Flow::Continue, "deposed by its own raise");
    rig.run_until(|lp| lp.replicas[1].mode == Mode::Out).await;
    assert!(rig.dir.recorded().contains(&(2, ComponentState::Absent)));
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
    // Under the current generation, a refusal is another owner's.
    let flow = rig.internal(Internal::RecordConflict {
        idx: 1,
        state: ComponentState::Absent,
        generation: 2,
    });
    assert_eq!(flow, Flow::Stop);
}

#[tokio::test]
async fn no_resync_starts_while_a_lost_copy_is_being_reconnected() {
    // Copy 1 lost (reconnecting), copy 2 out but up: a resync's raise
    // could overtake the reconnection's activation, so it waits.
    let specs = [
        copy(1, Mode::InSync, 1).disconnected(),
        copy(2, Mode::Out, 0),
        witness(3),
    ];
    let mut rig = rig(&specs).await;
    rig.lp.replicas[0].reconnecting = true;
    rig.lp.consider_resync();
    assert!(rig.lp.resync.is_none());
    rig.lp.replicas[0].reconnecting = false;
    rig.lp.replicas[0].peer = rig.lp.replicas[1].peer.clone();
}
