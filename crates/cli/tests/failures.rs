//! Failure tests on real node processes: kill -9 and SIGSTOP of replicas,
//! of the owner and of the directory leader during a fio verify workload,
//! every node killed at once under writes, and a whole-cluster restart.

mod common;

use common::fio::{finish, fio_verify_only, fio_write_verify};
use common::ledger::Writer;
use common::{pid_alive, require, sh, wait_for, Cluster};
use std::time::Duration;

const HEAL: Duration = Duration::from_secs(90);
/// Time allowed for a load to reach its goal on a slow machine.
const LOAD: Duration = Duration::from_secs(300);

/// NBD writes a client's node must have served before a fault is injected
/// into a fio run (16 MiB of 4 KiB writes: the fault lands early in the
/// write pass, with data on every copy already).
const WRITES_BEFORE_FAULT: u64 = 4096;

/// Waits until `node` has served `more` NBD writes beyond `from` (its
/// `shoal_nbd_writes_total`), so that a fault lands in the middle of the
/// client's writes, not before they begin.
fn wait_writes(c: &Cluster, node: u32, from: u64, more: u64) {
    c.wait_metric(&[node], "shoal_nbd_writes_total", from + more, HEAL);
}

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
    let c = Cluster::start(4);
    c.create_volume("v", "256M", "raid1 ftt=1");
    own_from_node1(&c, "v");
    let victim = replica_victim(&c, "v", 1);
    let client = if victim == 2 { 3 } else { 2 };
    let fio = fio_write_verify(&c.uri(client, "v"), "96M");
    wait_writes(&c, client, 0, WRITES_BEFORE_FAULT);
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
    let c = Cluster::start(4);
    c.create_volume("v", "256M", "raid1 ftt=1");
    own_from_node1(&c, "v");
    let victim = replica_victim(&c, "v", 1);
    let client = if victim == 2 { 3 } else { 2 };
    let fio = fio_write_verify(&c.uri(client, "v"), "128M");
    wait_writes(&c, client, 0, WRITES_BEFORE_FAULT);
    c.signal(victim, "STOP");
    // The pause matters once the owner gives up on the copy (its I/O
    // timeout) and writes go on without it; from then on, how long the
    // node stays stopped changes nothing.
    c.wait_component_state("v", victim, "Absent", HEAL);
    c.signal(victim, "CONT");
    finish(fio);
    c.wait_healthy("v", HEAL);
    fio_verify_only(&c.uri(4, "v"), "128M");
    c.verify_copies("v");
}

#[test]
fn owner_and_leader_kill_pause_io_but_lose_nothing() {
    require("fio");
    let c = Cluster::start(4);
    c.create_volume("v", "256M", "raid1 ftt=1");
    own_from_node1(&c, "v");
    // The client is on a node that survives; node 1 is the owner.
    let fio = fio_write_verify(&c.uri(3, "v"), "96M");
    wait_writes(&c, 3, 0, WRITES_BEFORE_FAULT);
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
    let served = c.metric(&[client], "shoal_nbd_writes_total");
    let fio = fio_write_verify(&c.uri(client, "v"), "64M");
    wait_writes(&c, client, served, WRITES_BEFORE_FAULT);
    // One fault at a time: both copies in sync when the leader goes (it
    // may own the volume too; a copy that fell behind under this load,
    // seen once in CI, would leave none to serve from).
    c.wait_healthy("v", HEAL);
    c.signal(leader, "KILL");
    finish(fio);
    c.up();
    c.wait_healthy("v", HEAL);
    fio_verify_only(&c.uri(client, "v"), "64M");
    c.verify_copies("v");
}

/// Every node killed -9 at once while a client writes (the whole cluster
/// crashes, as far as processes go: what the stores had not written to
/// their devices is gone), twice. After each `shoal up`, read at once
/// (the volume serves while its marked regions are reconciled), every
/// write the cluster acknowledged is there, no block went back to an older version
/// or holds torn contents, reads through two other nodes agree, and so do
/// the two copies. The devices are small, so that each store's log wraps
/// and its cleaner works before the first cut. The second round starts
/// from what the first left, so it also crashes a cluster that has just
/// recovered.
#[test]
fn whole_cluster_kill9_loses_no_acknowledged_write() {
    let c = Cluster::start_sized(4, "256M", &[]);
    c.create_volume("v", "96M", "raid1 ftt=1");
    let (data, _) = layout(&c, "v");
    let mut versions = vec![0u32; (96 << 20) / 4096];
    // Round 1 writes until the cleaner of every data device has cleaned
    // segments (its log wrapped: about 55,000 writes); round 2 writes
    // 30,000, a cluster that just recovered under load.
    for round in [1, 2] {
        let w = Writer::start(&c.nbd_addr(1), "v", versions, 16);
        if round == 1 {
            wait_for("the cleaner at work on every data device", LOAD, || {
                let mut per = Vec::new();
                for &n in &data {
                    per.push(c.try_metric(&[n], "shoal_device_cleaned_segments_total")?);
                }
                if per.iter().all(|&k| k > 0) {
                    Ok(())
                } else {
                    Err(format!(
                        "segments cleaned on nodes {data:?}: {per:?} after {} writes",
                        w.ledger().acks()
                    ))
                }
            });
        } else {
            wait_for("30,000 acknowledged writes", LOAD, || {
                match w.ledger().acks() {
                    n if n >= 30_000 => Ok(()),
                    n => Err(format!("{n} acknowledged")),
                }
            });
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
        // Read at once, while the new owner may still reconcile the
        // regions marked on the devices in the background: every read is
        // right whether its region is reconciled yet or not.
        let through2 = ledger.check(&c.nbd_addr(2), "v");
        c.wait_healthy("v", HEAL);
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
    let c = Cluster::start(4);
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

/// Busy loops beside the cluster (`yes > /dev/null`), ended when dropped:
/// the CPU contention under which a dying peer's broken connections took
/// the owner down with SIGPIPE.
struct CpuLoad(Vec<std::process::Child>);

impl CpuLoad {
    fn start(loops: usize) -> CpuLoad {
        CpuLoad(
            (0..loops)
                .map(|_| {
                    std::process::Command::new("yes")
                        .stdout(std::process::Stdio::null())
                        .spawn()
                        .expect("yes")
                })
                .collect(),
        )
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Whether the node's process (by its pid file) still runs (a zombie
/// does not).
fn alive(c: &Cluster, node: u32) -> bool {
    pid_alive(c.pid(node))
}

/// A client that asks node 1 for large reads and goes without reading the
/// answers: node 1's replies meet a closed connection (`EPIPE`, and
/// SIGPIPE unless it is ignored).
fn client_that_vanishes(c: &Cluster, volume: &str) {
    use std::io::Write;
    let mut s = common::ledger::connect(&c.nbd_addr(1), volume);
    for i in 0..8u64 {
        let req = shoal_nbd::codec::Request {
            flags: 0,
            command: shoal_nbd::codec::Command::Read,
            handle: i,
            offset: i << 22,
            len: 4 << 20,
        };
        s.write_all(&req.encode()).expect("sending a read");
    }
    // Closed with replies arriving unread: the kernel answers them with a
    // reset.
    drop(s);
}

/// A client writes through node 1 (the owner) at QD16, with two CPU loops
/// beside the cluster, while each other node in turn is killed -9 and
/// restarted with `shoal up`, and a client goes without reading the
/// answers to its reads. Node 1 must live through it all (a write to
/// a dead peer's socket once killed it with SIGPIPE, silently), no write
/// may fail, and every acknowledged write must be there afterwards, on
/// both copies.
#[test]
fn peer_deaths_under_cpu_load_never_take_the_owner_down() {
    let c = Cluster::start(4);
    c.create_volume("v", "64M", "raid1 ftt=1");
    let _load = CpuLoad::start(2);
    let owner_pid = c.pid(1);
    let w = Writer::start(&c.nbd_addr(1), "v", vec![0u32; (64 << 20) / 4096], 16);
    let wait_writes = |what: &str, more: u64| {
        let from = w.ledger().acks();
        wait_for(what, Duration::from_secs(60), || {
            assert!(alive(&c, 1), "node 1 died:\n{}", c.logs());
            let now = w.ledger().acks();
            if now >= from + more {
                Ok(())
            } else {
                Err(format!("{} acknowledged", now - from))
            }
        });
    };
    wait_writes("writes before the first kill", 2_000);
    assert_eq!(layout(&c, "v").1, Some(1), "node 1 owns the volume");
    for victim in [2, 3, 4, 2] {
        client_that_vanishes(&c, "v");
        c.signal(victim, "KILL");
        wait_writes("writes with a node dead", 1_000);
        c.up();
        c.wait_node(victim, "up", HEAL);
        c.wait_healthy("v", HEAL);
        wait_writes("writes after the restart", 1_000);
        assert!(alive(&c, 1), "node 1 died:\n{}", c.logs());
        assert_eq!(c.pid(1), owner_pid, "node 1 was restarted");
        assert_eq!(w.ledger().errors(), 0, "writes failed");
    }
    let ledger = w.stop(Duration::from_secs(30));
    assert_eq!(ledger.errors(), 0, "writes failed");
    eprintln!(
        "{} writes acknowledged over {} blocks",
        ledger.acks(),
        ledger.written()
    );
    assert!(alive(&c, 1), "node 1 died:\n{}", c.logs());
    let through2 = ledger.check(&c.nbd_addr(2), "v");
    let through3 = ledger.check(&c.nbd_addr(3), "v");
    assert!(through2 == through3, "two nodes read different versions");
    c.verify_copies("v");
}

/// A node that ends says why, in `shoal status` and at the next `shoal
/// up`: a caught fatal signal is named, a kill -9 is told apart, a stop on
/// request is exit 0, and the last lines of the log come with it.
#[test]
fn a_node_that_ends_says_why() {
    let c = Cluster::start(3);
    c.signal(2, "SEGV");
    c.signal(3, "KILL");
    wait_for("nodes 2 and 3 gone", Duration::from_secs(20), || {
        if alive(&c, 2) || alive(&c, 3) {
            Err("still running".into())
        } else {
            Ok(())
        }
    });
    let status = c.shoal(&["status"]);
    assert!(
        status.contains("node 2 is not running: killed by SIGSEGV"),
        "{status}"
    );
    assert!(
        status.contains("node 3 is not running: ended without a word"),
        "{status}"
    );
    assert!(status.contains("last lines of"), "{status}");
    let log2 = std::fs::read_to_string(c.node_dir(2).join("node.log")).expect("log");
    assert!(log2.contains("fatal signal: killed by SIGSEGV"), "{log2}");
    let json = c.json(&["status"]);
    let stopped = json["stopped_local_nodes"]
        .as_array()
        .expect("stopped nodes");
    assert_eq!(stopped.len(), 2, "{json}");

    let up = c.shoal(&["up", "--no-demo"]);
    assert!(
        up.contains("node 2 was not running: killed by SIGSEGV"),
        "{up}"
    );
    c.wait_node(2, "up", HEAL);
    c.wait_node(3, "up", HEAL);
    let status = c.shoal(&["status"]);
    assert!(!status.contains("is not running"), "{status}");

    // A stop on request: exit 0, recorded.
    c.signal(3, "TERM");
    wait_for("node 3 stopped", Duration::from_secs(20), || {
        if alive(&c, 3) {
            Err("still running".into())
        } else {
            Ok(())
        }
    });
    let rec = std::fs::read_to_string(c.node_dir(3).join("node.exit")).expect("record");
    assert_eq!(rec.trim(), "exit 0: stopped on SIGTERM");
}
