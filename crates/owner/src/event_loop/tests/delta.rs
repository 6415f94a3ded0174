//! Delta resync: barriers track while a copy is out, a returning copy
//! gets only the regions tracked, and is seeded with them first.

use super::fakes::{answer, copy, rig, witness, write};
use super::returning;
use crate::event_loop::replica::Mode;
use crate::REGION;
use bytes::Bytes;
use shoal_rpc::{RegionSet, Request};

/// The `track` flag of the barriers copy `i` received, in order.
fn barrier_tracks(rig: &super::fakes::Rig, i: usize) -> Vec<bool> {
    rig.requests(i)
        .iter()
        .filter_map(|r| match r {
            Request::Barrier { track, .. } => Some(*track),
            _ => None,
        })
        .collect()
}

/// Offsets of the regions copied to copy `i` (writes without a sequence
/// number), in order.
fn copied(rig: &super::fakes::Rig, i: usize) -> Vec<u64> {
    rig.requests(i)
        .iter()
        .filter_map(|r| match r {
            Request::Write { offset, seq: 0, .. } | Request::WriteZeroes { offset, seq: 0, .. } => {
                Some(offset / REGION)
            }
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn barriers_track_while_a_copy_is_out_and_one_empties_the_sets_once_it_is_back() {
    let mut rig = rig(&returning()).await;
    rig.fakes[0].track(RegionSet::Runs(vec![]));
    let ack = rig.submit(write(0, 4096, 9));
    rig.finish_write().await;
    assert_eq!(answer(ack).await, Ok(Bytes::new()));
    rig.tick();
    assert_eq!(barrier_tracks(&rig, 0), vec![true], "copy 2 is out");
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert_eq!(rig.lp.replicas[1].mode, Mode::InSync);
    // No write since: one barrier all the same, without track, to both.
    rig.tick();
    assert_eq!(barrier_tracks(&rig, 0), vec![true, false]);
    assert_eq!(barrier_tracks(&rig, 1).last(), Some(&false));
    rig.tick();
    assert_eq!(barrier_tracks(&rig, 0), vec![true, false], "nothing new");
}

#[tokio::test]
async fn a_returning_copy_gets_only_the_regions_tracked_and_tracks_them_first() {
    let mut rig = rig(&returning()).await;
    rig.fakes[0].allocate(&[(0, 4 * REGION)]);
    rig.fakes[0].track(RegionSet::Runs(vec![(1, 1)]));
    // The target's own report: a write it had in flight when it left.
    rig.fakes[1].track(RegionSet::Runs(vec![(3, 1)]));
    rig.tick();
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert_eq!(rig.lp.replicas[1].mode, Mode::InSync);
    assert_eq!(copied(&rig, 1), vec![1, 3]);
    let sent = rig.requests(1);
    let seed = sent
        .iter()
        .position(|r| matches!(r, Request::Track { regions, .. } if *regions == RegionSet::Runs(vec![(1, 1), (3, 1)])))
        .expect("the target is seeded with the plan");
    let first_copy = sent
        .iter()
        .position(|r| {
            matches!(
                r,
                Request::Write { seq: 0, .. } | Request::WriteZeroes { seq: 0, .. }
            )
        })
        .expect("a region copied");
    assert!(seed < first_copy, "seeded before the first copy: {sent:?}");
}

#[tokio::test]
async fn a_tracked_set_of_all_copies_what_is_allocated() {
    let mut rig = rig(&returning()).await;
    rig.fakes[0].allocate(&[(2 * REGION, 10)]);
    rig.fakes[0].track(RegionSet::Runs(vec![(0, 1)]));
    rig.fakes[1].track(RegionSet::All);
    rig.tick();
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert_eq!(copied(&rig, 1), vec![2]);
}

#[tokio::test]
async fn a_copy_whose_device_failed_is_copied_in_full_without_asking_what_was_tracked() {
    let mut rig = rig(&[copy(1, Mode::InSync, 5), copy(2, Mode::Out, 0), witness(3)]).await;
    rig.lp.replicas[1].degraded = true;
    rig.lp.rebuild.problem = Some("no other domain".into());
    rig.fakes[0].allocate(&[(0, 2 * REGION)]);
    rig.fakes[0].track(RegionSet::Runs(vec![]));
    rig.fakes[1].track(RegionSet::Runs(vec![]));
    rig.tick();
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert_eq!(copied(&rig, 1), vec![0, 1]);
    for i in [0, 1] {
        assert!(!rig
            .requests(i)
            .iter()
            .any(|r| matches!(r, Request::TrackedRegions { .. })));
    }
}

#[tokio::test]
async fn a_tracked_set_out_of_order_fails_the_plan_and_copies_nothing() {
    let mut rig = rig(&returning()).await;
    rig.fakes[0].allocate(&[(0, 4 * REGION)]);
    rig.fakes[0].track(RegionSet::Runs(vec![(3, 1), (1, 1)]));
    rig.fakes[1].track(RegionSet::Runs(vec![]));
    rig.tick();
    rig.run_until(|lp| lp.resync.is_none()).await;
    assert_eq!(
        rig.lp.replicas[1].mode,
        Mode::Out,
        "the attempt is given up"
    );
    assert_eq!(copied(&rig, 1), Vec::<u64>::new());
}
