//! Failure tests on real node processes: kill -9 and SIGSTOP of replicas,
//! of the owner and of the directory leader during a fio verify workload,
//! every node killed at once under writes, and a whole-cluster restart.
//! Subnets 127.0.30-39.

mod common;

use common::fio::{finish, fio_verify_only, fio_write_verify};
use common::ledger::Writer;
use common::{require, sh, Cluster};
use std::time::Duration;

const HEAL: Duration = Duration::from_secs(90);

/// The nodes holding data copies, and the owner, of a volume.
fn layout(c: &Cluster, vol: &str) -> (Vec<u32>, Option<u32>) {
    let v = c.json(&["volume", "show", vol]);
    let data = v["volume"]["components"]
        .as_array()
        .expect("components")
        .iter()
        .filter(|x| x["role"] == "Data")
        .map(|x| x["node"].as_u64().expect("node") as u32)
        .collect();
    let owner = v["volume"]["owner"].as_u64().map(|o| o as u32);
    (data, owner)
}

/// Makes node 1 the owner by doing I/O through it.
fn own_from_node1(c: &Cluster, vol: &str) {
    sh(&format!(
        "qemu-io -f raw -c 'write -P 7 0 4k' {}",
        c.uri(1, vol)
    ));
    assert_eq!(layout(c, vol).1, Some(1));
}

/// A data node other than node 1 and other than `avoid`.
fn replica_victim(c: &Cluster, vol: &str, avoid: u32) -> u32 {
    let (data, _) = layout(c, vol);
    *data
        .iter()
        .find(|&&n| n != 1 && n != avoid)
        .expect("a data copy outside node 1")
}

#[test]
fn kill9_replica_during_fio_verify() {
    require("fio");
    let c = Cluster::start(4, 30);
    c.create_volume("v", "256M", "raid1 ftt=1");
    own_from_node1(&c, "v");
    let victim = replica_victim(&c, "v", 1);
    let client = if victim == 2 { 3 } else { 2 };
    let fio = fio_write_verify(&c.uri(client, "v"), "96M");
    std::thread::sleep(Duration::from_secs(3));
    c.signal(victim, "KILL");
    finish(fio);
    assert_ne!(
        c.health("v"),
        "healthy",
        "a killed copy must not look healthy"
    );
    c.up();
    c.wait_healthy("v", HEAL);
    // Read everything back through a third node, and compare the copies.
    fio_verify_only(&c.uri(4, "v"), "96M");
    c.verify_copies("v");
}

#[test]
fn sigstop_replica_during_fio_verify() {
    require("fio");
    let c = Cluster::start(4, 31);
    c.create_volume("v", "256M", "raid1 ftt=1");
    own_from_node1(&c, "v");
    let victim = replica_victim(&c, "v", 1);
    let client = if victim == 2 { 3 } else { 2 };
    let fio = fio_write_verify(&c.uri(client, "v"), "128M");
    std::thread::sleep(Duration::from_secs(2));
    c.signal(victim, "STOP");
    std::thread::sleep(Duration::from_secs(10));
    c.signal(victim, "CONT");
    finish(fio);
    c.wait_healthy("v", HEAL);
    fio_verify_only(&c.uri(4, "v"), "128M");
    c.verify_copies("v");
}

#[test]
fn owner_and_leader_kill_pause_io_but_lose_nothing() {
    require("fio");
    let c = Cluster::start(4, 32);
    c.create_volume("v", "256M", "raid1 ftt=1");
    own_from_node1(&c, "v");
    // The client is on a node that survives; node 1 is the owner.
    let fio = fio_write_verify(&c.uri(3, "v"), "96M");
    std::thread::sleep(Duration::from_secs(3));
    c.signal(1, "KILL");
    finish(fio);
    let (_, owner) = layout(&c, "v");
    assert!(
        owner.is_some() && owner != Some(1),
        "ownership moved: {owner:?}"
    );
    c.up();
    c.wait_healthy("v", HEAL);

    // Now kill the directory leader (unless it is the client's node).
    let st = c.json(&["status"]);
    let leader = st["leader"].as_u64().expect("a leader") as u32;
    let client = if leader == 4 { 2 } else { 4 };
    let fio = fio_write_verify(&c.uri(client, "v"), "64M");
    std::thread::sleep(Duration::from_secs(2));
    c.signal(leader, "KILL");
    finish(fio);
    c.up();
    c.wait_healthy("v", HEAL);
    fio_verify_only(&c.uri(client, "v"), "64M");
    c.verify_copies("v");
}

/// Every node killed -9 at once while a client writes (the whole cluster
/// crashes, as far as processes go: what the stores had not written to
/// their devices is gone), twice. After each `shoal up`, every write the
/// cluster acknowledged is there, no block went back to an older version
/// or holds torn contents, reads through two other nodes agree, and so do
/// the two copies. The devices are small, so that each store's log wraps
/// and its cleaner works before the first cut. The second round starts
/// from what the first left, so it also crashes a cluster that has just
/// recovered.
#[test]
fn whole_cluster_kill9_loses_no_acknowledged_write() {
    let c = Cluster::start_sized(4, 34, "256M", &[]);
    c.create_volume("v", "96M", "raid1 ftt=1");
    let (data, _) = layout(&c, "v");
    let mut versions = vec![0u32; (96 << 20) / 4096];
    // Enough writes for the cleaner to run (about twice the free space of a
    // device), then fewer; or as many as a slow machine gives in the time.
    for (round, goal) in [(1, 100_000), (2, 30_000)] {
        let w = Writer::start(&c.nbd_addr(1), "v", versions, 16);
        let started = std::time::Instant::now();
        while w.ledger().acks() < goal && started.elapsed() < Duration::from_secs(40) {
            std::thread::sleep(Duration::from_millis(100));
        }
        let cleaned = c.metric(&data, "shoal_device_cleaned_segments_total");
        let pids: Vec<String> = (1..=4).map(|n| c.pid(n).to_string()).collect();
        sh(&format!("kill -KILL {}", pids.join(" ")));
        let ledger = w.wait_cut();
        let (acks, written, errors) = (ledger.acks(), ledger.written(), ledger.errors());
        eprintln!(
            "round {round}: cut after {acks} acknowledged writes over {written} blocks \
             ({errors} answered with an error); {cleaned} segments cleaned"
        );
        assert!(acks >= 5_000, "too few writes before the cut: {acks}");
        // Only writes in flight at the cut (16 at most) may fail.
        assert!(errors <= 16, "{errors} writes failed");
        c.up();
        c.wait_healthy("v", HEAL);
        let through2 = ledger.check(&c.nbd_addr(2), "v");
        let through3 = ledger.check(&c.nbd_addr(3), "v");
        assert!(through2 == through3, "two nodes read different versions");
        c.verify_copies("v");
        versions = through2;
    }
    // The copies agree because the new owners copied the regions marked
    // on the devices, not by chance.
    let reconciled: usize = (1..=4)
        .map(|n| std::fs::read_to_string(c.node_dir(n).join("node.log")).unwrap_or_default())
        .map(|log| log.matches("reconciling regions left in flight").count())
        .sum();
    assert!(
        reconciled >= 2,
        "owners reconciled marked regions {reconciled} times, not after each cut"
    );
}

#[test]
fn down_then_up_keeps_volumes_and_data() {
    require("nbdcopy");
    let c = Cluster::start(4, 33);
    c.create_volume("a", "64M", "raid1 ftt=1");
    c.create_volume("b", "32M", "ftt=0");
    let dir = tempfile::tempdir().expect("tmp");
    let src = dir.path().join("src.img");
    let back = dir.path().join("back.img");
    sh(&format!("head -c 64M /dev/urandom > {}", src.display()));
    sh(&format!("nbdcopy {} {}", src.display(), c.uri(2, "a")));
    c.shoal(&["down"]);
    c.up();
    let list = c.json(&["volume", "list"]);
    let names: Vec<&str> = list
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|v| v["volume"]["name"].as_str())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    sh(&format!("nbdcopy {} {}", c.uri(3, "a"), back.display()));
    sh(&format!("cmp {} {}", src.display(), back.display()));
    c.wait_healthy("a", HEAL);
    c.verify_copies("a");
}
