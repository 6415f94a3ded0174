//! Erasure-coded volumes (`raid5`, `raid6`) on real node processes
//! (`docs/erasure-coding.md`): fio verify through NBD while the node of a
//! stripe column (two for raid6) is killed -9, the column back in service
//! and every staged block destaged once its node returns, every node
//! killed at once while stripes are being destaged, growth (`volume
//! resize`) through kills of the owner, and what the cluster refuses of
//! such volumes.

mod common;

use common::bitrot::{device_paths, find_blocks, flip_bit, wait_scrub_passes};
use common::fio::{assert_fio_clean, finish, fio_verify_only, fio_write_verify};
use common::ledger::{connect, Runs, Writer};
use common::{components_of, ok, require, run, sh, wait_for, Cluster};
use shoal_nbd::codec::{Command as Nbd, Request, SimpleReply, SIMPLE_REPLY_LEN};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const HEAL: Duration = Duration::from_secs(120);
/// Time allowed for a load to reach its goal on a slow machine.
const LOAD: Duration = Duration::from_secs(300);
/// NBD writes the client's node must have served before a fault (16 MiB
/// of 4 KiB writes: stripes are destaged by then).
const WRITES_BEFORE_FAULT: u64 = 4096;

/// The nodes of `vol`'s components of role `role` ("Data", "Witness",
/// or "stripe" for the stripe columns), in the order `volume show` lists
/// them.
fn nodes_of(c: &Cluster, vol: &str, role: &str) -> Vec<u32> {
    let v = c.json(&["volume", "show", vol]);
    v["volume"]["components"]
        .as_array()
        .expect("components")
        .iter()
        .filter(|x| match role {
            "stripe" => x["role"].get("Stripe").is_some(),
            r => x["role"] == r,
        })
        .map(|x| x["node"].as_u64().expect("node") as u32)
        .collect()
}

/// Makes node 1 the owner by doing I/O through it.
fn own_from_node1(c: &Cluster, vol: &str) {
    own_from(c, vol, 1);
}

/// Makes node `node` the owner of `vol` (which has none) by doing I/O
/// through it.
fn own_from(c: &Cluster, vol: &str, node: u32) {
    sh(&format!(
        "qemu-io -f raw -c 'write -P 7 0 4k' {}",
        c.uri(node, vol)
    ));
    let v = c.json(&["volume", "show", vol]);
    assert_eq!(v["volume"]["owner"], node, "{v}");
}

/// The node that owns `vol` now.
fn owner_of(c: &Cluster, vol: &str) -> u32 {
    let v = c.json(&["volume", "show", vol]);
    v["volume"]["owner"]
        .as_u64()
        .unwrap_or_else(|| panic!("{vol} has no owner: {v}")) as u32
}

/// Waits until the owner on `owner` has every column in service and
/// nothing left on the performance leg: everything written is in stripes.
fn wait_destaged(c: &Cluster, owner: u32, vol: &str) {
    let staged = format!("shoal_volume_staged_blocks{{node=\"{owner}\",volume=\"{vol}\"}} 0");
    let out = format!("shoal_volume_stripe_columns_out{{node=\"{owner}\",volume=\"{vol}\"}} 0");
    wait_for(&format!("{vol} destaged on node {owner}"), LOAD, || {
        let m = c.try_rest(owner, "/metrics", &[])?;
        match m.contains(&staged) && m.contains(&out) {
            true => Ok(()),
            false => Err(m
                .lines()
                .filter(|l| l.starts_with("shoal_volume_st"))
                .collect::<Vec<_>>()
                .join("; ")),
        }
    });
}

/// What the cluster refuses of an erasure-coded volume, each with why.
fn refusals(c: &Cluster, vol: &str) {
    let e = c.shoal_fails(&[
        "volume", "create", "r6", "--size", "64M", "--policy", "raid6",
    ]);
    assert!(e.contains("fault domains"), "{e}");
    let e = c.shoal_fails(&[
        "volume",
        "create",
        "r52",
        "--size",
        "64M",
        "--policy",
        "raid5 ftt=2",
    ]);
    assert!(
        e.contains("raid5 tolerates exactly ftt=1, not ftt=2"),
        "{e}"
    );
    // raid5 to raid6 goes through raid1 ftt=2 and needs six hosts: refused
    // on four before its first step, the volume left as it is.
    let e = c.shoal_fails(&["volume", "set-policy", vol, "--policy", "raid6 ftt=2"]);
    assert!(
        e.contains("raid6 ftt=2 needs 6 fault domains; the cluster has 4"),
        "{e}"
    );
    let v = c.json(&["volume", "show", vol]);
    assert_eq!(v["volume"]["policy"]["layout"], "Raid5", "{v}");
    assert_eq!(v["volume"]["reconfig"], serde_json::Value::Null, "{v}");
    // Growing is built (`raid5_grows_under_fio_verify_and_through_a_kill_of_its_owner`);
    // shrinking is refused, as for any volume, and leaves it as it is.
    let before = v["volume"]["size"].as_u64().expect("size");
    let e = c.shoal_fails(&["volume", "resize", vol, "--size", "128M"]);
    assert!(e.contains("cannot shrink"), "{e}");
    let v = c.json(&["volume", "show", vol]);
    assert_eq!(v["volume"]["size"], before, "{v}");
    assert!(v["volume"]["grow_to"].is_null(), "{v}");
}

/// Sends one request (with `data` for a write) and returns the reply's
/// error and, for a read that succeeded, its data.
fn ask(s: &mut TcpStream, command: Nbd, offset: u64, len: u32, data: &[u8]) -> (u32, Vec<u8>) {
    let req = Request {
        flags: 0,
        command,
        handle: offset ^ u64::from(len),
        offset,
        len,
    };
    s.write_all(&req.encode()).expect("sending a request");
    s.write_all(data).expect("sending data");
    let mut h = [0u8; SIMPLE_REPLY_LEN];
    s.read_exact(&mut h).expect("reading a reply header");
    let r = SimpleReply::decode(&h).expect("a simple reply");
    assert_eq!(r.handle, req.handle, "reply to another request");
    let mut got = Vec::new();
    if r.error == 0 && command == Nbd::Read {
        got = vec![0u8; len as usize];
        s.read_exact(&mut got).expect("reading data");
    }
    (r.error, got)
}

/// Requests a careless or hostile client sends an erasure-coded volume
/// of `size` bytes: past its end, unaligned, zeroes and trims over parts
/// of blocks. Each is answered (an error where it cannot be done), on one
/// connection that keeps working, and what reads back is exactly what was
/// written.
fn hostile_requests(c: &Cluster, vol: &str, size: u64) {
    let mut s = connect(&c.nbd_addr(1), vol);
    let pattern: Vec<u8> = (0..12288u32).map(|i| (i * 7 + 3) as u8).collect();
    assert_eq!(ask(&mut s, Nbd::Write, 0, 12288, &pattern).0, 0);
    // Past the end, straddling it, and at offsets that overflow.
    for (offset, len) in [(size, 4096), (size - 4096, 8192), (u64::MAX - 100, 4096)] {
        assert_ne!(
            ask(&mut s, Nbd::Write, offset, len, &vec![9; len as usize]).0,
            0
        );
        assert_ne!(ask(&mut s, Nbd::Read, offset, len, &[]).0, 0);
        assert_ne!(ask(&mut s, Nbd::WriteZeroes, offset, len, &[]).0, 0);
    }
    // Unaligned: a write over parts of three blocks, then zeroes and a
    // trim over parts of blocks.
    let mut want = pattern.clone();
    let part = vec![0xA5u8; 5000];
    assert_eq!(ask(&mut s, Nbd::Write, 1000, 5000, &part).0, 0);
    want[1000..6000].copy_from_slice(&part);
    assert_eq!(ask(&mut s, Nbd::WriteZeroes, 7000, 3000, &[]).0, 0);
    want[7000..10000].fill(0);
    assert_eq!(ask(&mut s, Nbd::Flush, 0, 0, &[]).0, 0);
    let (e, got) = ask(&mut s, Nbd::Read, 0, 12288, &[]);
    assert_eq!(e, 0);
    assert!(got == want, "unaligned writes and zeroes read back wrong");
    // A trim may drop data or not; it changes nothing outside its range.
    assert_eq!(ask(&mut s, Nbd::Trim, 512, 1024, &[]).0, 0);
    let (e, got) = ask(&mut s, Nbd::Read, 2048, 10240, &[]);
    assert_eq!(e, 0);
    assert!(got == want[2048..], "a trim changed what lies outside it");
    // A read of a few bytes of a block, unaligned.
    let (e, got) = ask(&mut s, Nbd::Read, 4097, 3, &[]);
    assert_eq!((e, &got[..]), (0, &want[4097..4100]));
}

/// A raid5 volume on four hosts: 2+1 stripes, a performance leg of two
/// copies and a witness. fio writes and verifies it while the node of a
/// data copy and a stripe column is killed -9; the writes go on (the
/// column's blocks are rebuilt on read, new writes stay on the leg), and
/// once the node is back its column returns, every staged block is
/// destaged, and everything reads back through another node.
#[test]
fn raid5_survives_the_kill_of_a_column_node_under_fio_verify() {
    require("fio");
    let c = Cluster::start(4);
    c.create_volume("e", "256M", "raid5");
    let text = c.shoal(&["volume", "show", "e"]);
    assert!(
        text.contains("2+1 stripes over 3 stripe components"),
        "{text}"
    );
    assert_eq!(nodes_of(&c, "e", "stripe").len(), 3, "{text}");
    refusals(&c, "e");
    own_from_node1(&c, "e");
    hostile_requests(&c, "e", 256 << 20);
    let columns = nodes_of(&c, "e", "stripe");
    let data = nodes_of(&c, "e", "Data");
    let victim = *columns
        .iter()
        .find(|n| **n != 1 && data.contains(n))
        .unwrap_or_else(|| panic!("a node with a copy and a column: {text}"));
    let client = (2..=4).find(|n| *n != victim).expect("a client node");
    let fio = fio_write_verify(&c.uri(client, "e"), "128M");
    c.wait_metric(
        &[client],
        "shoal_nbd_writes_total",
        WRITES_BEFORE_FAULT,
        HEAL,
    );
    assert!(c.metric(&[1], "shoal_volume_stripes_written_total") > 0);
    c.signal(victim, "KILL");
    finish(fio);
    assert_eq!(c.metric(&[1], "shoal_volume_stripe_columns_out"), 1);
    assert_ne!(
        c.health("e"),
        "healthy",
        "{}",
        components_of(&c.json(&["volume", "show", "e"]))
    );
    // Read back with the column still out: degraded reads.
    let other = (2..=4)
        .find(|n| *n != victim && *n != client)
        .expect("a third node");
    fio_verify_only(&c.uri(other, "e"), "128M");
    c.up();
    c.wait_healthy("e", HEAL);
    wait_destaged(&c, 1, "e");
    fio_verify_only(&c.uri(victim, "e"), "128M");
    lowering_survives_the_kill_of_its_owner(&c, "e", 1);
}

/// `vol` (raid5, owned by node `owner`, its data in stripes) lowered to
/// raid1 ftt=1, its owner killed -9 while it reads the stripes back: the
/// next owner carries the change out, and the data fio wrote verifies.
fn lowering_survives_the_kill_of_its_owner(c: &Cluster, vol: &str, owner: u32) {
    let out = c.shoal(&["volume", "set-policy", vol, "--policy", "raid1 ftt=1"]);
    assert!(
        out.contains("reads every block the stripes hold back"),
        "{out}"
    );
    c.wait_log(
        owner,
        &["lowering to RAID-1: reading the stripes back"],
        HEAL,
    );
    c.signal(owner, "KILL");
    c.up();
    wait_for(&format!("{vol} lowered to raid1"), LOAD, || {
        let v = c.try_json(&["volume", "show", vol])?;
        match (&v["volume"]["stripe"], &v["volume"]["reconfig"]) {
            (serde_json::Value::Null, serde_json::Value::Null) => Ok(()),
            _ => Err(components_of(&v)),
        }
    });
    let v = c.json(&["volume", "show", vol]);
    assert_eq!(v["volume"]["policy"]["layout"], "Raid1", "{v}");
    // The killed owner had not ended it: a second owner read back too.
    let logs = whole_logs(c);
    let begun = logs
        .matches("lowering to RAID-1: reading the stripes back")
        .count();
    assert_eq!(begun, 2, "the killed owner and the next began the lowering");
    fio_verify_only(&c.uri(owner, vol), "128M");
    c.verify_copies(vol);
}

/// A client writes a raid5 volume with 4 KiB writes and, every eighth,
/// 512 KiB ones (two 2+1 stripes straight to the columns, four blocks
/// staged). The node of a stripe column is killed -9 (direct stripes in
/// flight fail and are staged instead, and large writes are staged while
/// it is out) and comes back; then every node is killed -9 at once while
/// stripes of both kinds are being written: after `shoal up` every
/// acknowledged write reads back (no block older, none torn), through two
/// nodes, before and after the new owner destaged what the leg held.
#[test]
fn raid5_whole_cluster_kill_during_destage_loses_no_acknowledged_write() {
    let c = Cluster::start(4);
    c.create_volume("e", "64M", "raid5");
    let versions = vec![0u32; (64 << 20) / 4096];
    let runs = Runs {
        every: 8,
        blocks: 128,
    };
    let w = Writer::start_with_runs(&c.nbd_addr(1), "e", versions, 16, runs);
    let stripes_under_writes = |acks_at_least: u64| {
        wait_for("stripes of both kinds under writes", LOAD, || {
            let acks = w.ledger().acks();
            let stripes = c.try_metric(&[1], "shoal_volume_stripes_written_total")?;
            let direct = c.try_metric(&[1], "shoal_volume_direct_stripes_total")?;
            let staged = c.try_metric(&[1], "shoal_volume_staged_blocks")?;
            let enough = acks >= acks_at_least && stripes >= direct + 50 && direct >= 50;
            match enough && staged > 0 {
                true => Ok(()),
                false => Err(format!(
                    "{acks} acks, {stripes} stripes ({direct} direct), {staged} staged"
                )),
            }
        })
    };
    stripes_under_writes(8_000);
    let owner = c.json(&["volume", "show", "e"])["volume"]["owner"].clone();
    assert_eq!(owner, 1, "the client's node owns the volume");
    let victim = *nodes_of(&c, "e", "stripe")
        .iter()
        .find(|&&n| n != 1)
        .expect("a column off the owner's node");
    c.signal(victim, "KILL");
    c.wait_metric(&[1], "shoal_volume_stripe_columns_out", 1, LOAD);
    w.wait_more("writes with a column out", 2_000, LOAD);
    c.up();
    wait_for("the column back in service", HEAL, || {
        match c.try_metric(&[1], "shoal_volume_stripe_columns_out")? {
            0 => Ok(()),
            n => Err(format!("{n} out")),
        }
    });
    let direct_before = c.metric(&[1], "shoal_volume_direct_stripes_total");
    wait_for("direct stripes again", LOAD, || {
        match c.try_metric(&[1], "shoal_volume_direct_stripes_total")? {
            n if n >= direct_before + 20 => Ok(()),
            n => Err(format!("{n} direct stripes")),
        }
    });
    assert_eq!(w.ledger().errors(), 0, "writes failed with a column out");
    let pids: Vec<String> = (1..=4).map(|n| c.pid(n).to_string()).collect();
    sh(&format!("kill -KILL {}", pids.join(" ")));
    let ledger = w.wait_cut();
    assert!(ledger.errors() <= 16, "{} writes failed", ledger.errors());
    c.up();
    let through2 = ledger.check(&c.nbd_addr(2), "e");
    let owner = c.json(&["volume", "show", "e"])["volume"]["owner"]
        .as_u64()
        .expect("an owner") as u32;
    wait_destaged(&c, owner, "e");
    let through3 = ledger.check(&c.nbd_addr(3), "e");
    assert!(through2 == through3, "two reads gave different versions");
}

/// A raid6 volume on six hosts: 4+2 stripes. fio writes and verifies it
/// while the nodes of two stripe columns are killed -9, and reads it back
/// with both still down (rows rebuilt from the four others) and once they
/// are back and everything is destaged.
#[test]
fn raid6_survives_two_column_nodes_killed_under_fio_verify() {
    require("fio");
    let c = Cluster::start(6);
    c.create_volume("e", "128M", "raid6");
    let text = c.shoal(&["volume", "show", "e"]);
    assert!(
        text.contains("4+2 stripes over 6 stripe components"),
        "{text}"
    );
    // raid5 is 4+1 on six hosts: written whole once and destaged, it
    // takes at most 1.55 times its data.
    c.create_volume("w", "64M", "raid5");
    let text = c.shoal(&["volume", "show", "w"]);
    assert!(
        text.contains("4+1 stripes over 5 stripe components"),
        "{text}"
    );
    sh(&format!(
        "qemu-io -f raw -c 'write -P 9 0 64M' -c flush {}",
        c.uri(1, "w")
    ));
    wait_destaged(&c, 1, "w");
    let (_, written, used) = wait_for("raid5 4+1 written bytes counted", HEAL, || {
        match capacity(&c, "w") {
            (s, w, u) if w == 64 << 20 => Ok((s, w, u)),
            other => Err(format!("{other:?}")),
        }
    });
    let overhead = used as f64 / written as f64;
    assert!(overhead <= 1.55, "raid5 4+1 takes {overhead:.3}x");
    eprintln!("raid5 4+1: {overhead:.3}x the data written on the devices");
    own_from_node1(&c, "e");
    let victims: Vec<u32> = nodes_of(&c, "e", "stripe")
        .into_iter()
        .filter(|n| *n != 1 && *n != 6)
        .take(2)
        .collect();
    assert_eq!(victims.len(), 2, "{text}");
    let fio = fio_write_verify(&c.uri(6, "e"), "64M");
    c.wait_metric(&[6], "shoal_nbd_writes_total", WRITES_BEFORE_FAULT, HEAL);
    for v in &victims {
        c.signal(*v, "KILL");
    }
    finish(fio);
    let out = "shoal_volume_stripe_columns_out{node=\"1\",volume=\"e\"} 2";
    let m = c.rest(1, "/metrics", &[]);
    assert!(m.contains(out), "{m}");
    fio_verify_only(&c.uri(1, "e"), "64M");
    c.up();
    c.wait_healthy("e", HEAL);
    wait_destaged(&c, 1, "e");
    fio_verify_only(&c.uri(victims[0], "e"), "64M");
}

/// (node, device file) of `vol`'s stripe column at `position`.
fn column_device(c: &Cluster, vol: &str, position: u64) -> (u32, std::path::PathBuf) {
    let v = c.json(&["volume", "show", vol]);
    let x = v["volume"]["components"]
        .as_array()
        .expect("components")
        .iter()
        .find(|x| x["role"]["Stripe"]["position"] == position)
        .unwrap_or_else(|| panic!("no stripe column {position}: {v}"))
        .clone();
    let node = x["node"].as_u64().expect("node") as u32;
    let device = x["device"].as_u64().expect("device");
    (node, device_paths(c)[&device].clone())
}

/// Flips a bit in every copy of each of `blocks` in the device file of
/// column `position` (one column only: each stripe row has one bad unit
/// at most), runs a scrub pass on every node and checks that bad blocks
/// were found on that column's node and all repaired from the other
/// columns, that the next pass finds none, and that the volume reads
/// back `content`.
fn rot_and_scrub(c: &Cluster, vol: &str, position: u64, blocks: &[Vec<u8>], content: &[u8]) {
    let (node, path) = column_device(c, vol, position);
    let mut found: Vec<u64> = blocks.iter().flat_map(|b| find_blocks(&path, b)).collect();
    // Flipped once each: two equal contents must not flip a bit back.
    found.sort_unstable();
    found.dedup();
    assert!(!found.is_empty(), "column {position}: no block found");
    for at in &found {
        flip_bit(&path, *at);
    }
    let nodes = [1, 2, 3];
    let passes = |n: u32| -> u64 {
        let r: serde_json::Value =
            serde_json::from_str(&c.rest(n, "/v1/scrub", &[])).expect("scrub json");
        r["passes"].as_u64().unwrap_or(0)
    };
    let done = nodes.iter().map(|&n| passes(n)).min().unwrap_or(0);
    let bad_before = c.metric(&[node], "shoal_scrub_bad_blocks_total");
    for n in nodes {
        c.rest(n, "/v1/scrub", &["-X", "POST"]);
    }
    wait_scrub_passes(c, &nodes, done + 1);
    let bad = c.metric(&[node], "shoal_scrub_bad_blocks_total") - bad_before;
    assert!(
        bad >= 1,
        "column {position} on node {node}: none of {} bad blocks found: {:?}",
        found.len(),
        nodes.map(|n| c.rest(n, "/v1/scrub", &[]))
    );
    assert_eq!(c.metric(&nodes, "shoal_scrub_unrepaired_total"), 0);
    let all_bad = c.metric(&nodes, "shoal_scrub_bad_blocks_total");
    for n in nodes {
        c.rest(n, "/v1/scrub", &["-X", "POST"]);
    }
    wait_scrub_passes(c, &nodes, done + 2);
    assert_eq!(c.metric(&nodes, "shoal_scrub_bad_blocks_total"), all_bad);
    let back = tempfile::NamedTempFile::new().expect("temp file");
    sh(&format!(
        "nbdcopy {} {}",
        c.uri(node, vol),
        back.path().display()
    ));
    let got = std::fs::read(back.path()).expect("read back");
    assert!(
        got == content,
        "column {position}: the volume reads back wrong"
    );
}

/// The scrubber on a raid5 volume's columns: flipped bits in data units
/// and in parity units are found by their CRC and rebuilt from the same
/// row of the other columns.
#[test]
fn the_scrubber_repairs_flipped_bits_in_a_data_and_a_parity_column() {
    require("nbdcopy");
    // Small devices: the test reads them whole to find the blocks.
    let c = Cluster::start_sized(3, "256M", &[]);
    c.create_volume("e", "4M", "raid5");
    // Blocks alternate between two contents. A stripe's two data units
    // hold runs of 31 blocks (a unit's first block is its summary), so
    // each row pairs an even and an odd block: its parity is one of two
    // blocks (one, if the code is symmetric), found nowhere else.
    let (a, b) = (vec![0x41u8; 4096], vec![0x42u8; 4096]);
    let content: Vec<u8> = (0..1024)
        .flat_map(|i| if i % 2 == 0 { a.clone() } else { b.clone() })
        .collect();
    let src = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(src.path(), &content).expect("source");
    sh(&format!(
        "nbdcopy {} {} && qemu-io -f raw -c flush {}",
        src.path().display(),
        c.uri(1, "e"),
        c.uri(1, "e")
    ));
    wait_destaged(&c, 1, "e");
    let codec =
        shoal_erasure::Codec::new(shoal_erasure::Geometry::new(2, 1).expect("2+1")).expect("codec");
    let parity = |x: &[u8], y: &[u8]| {
        let mut p = vec![0u8; 4096];
        codec.encode(&[x, y], &mut [&mut p]).expect("parity");
        p
    };
    let (p1, p2) = (parity(&a, &b), parity(&b, &a));
    for p in [&p1, &p2] {
        assert!(*p != a && *p != b && p.iter().any(|&x| x != 0));
    }
    rot_and_scrub(&c, "e", 0, &[a.clone(), b.clone()], &content);
    rot_and_scrub(&c, "e", 1, &[p1, p2], &content);
}

/// A raid5 volume whose column host dies for good: after the repair
/// delay the owner rebuilds the column on the spare host (recomputed
/// from the other two), the volume is healthy again without the dead
/// host, and everything written before and after reads back.
#[test]
fn a_lost_column_is_rebuilt_on_another_host() {
    require("fio");
    let c = Cluster::start_with(4, &["--repair-delay", "2s"]);
    c.create_volume("e", "64M", "raid5");
    own_from_node1(&c, "e");
    let fio = fio_write_verify(&c.uri(1, "e"), "64M");
    finish(fio);
    wait_destaged(&c, 1, "e");
    let victim = *nodes_of(&c, "e", "stripe")
        .iter()
        .find(|n| **n != 1)
        .expect("a column off node 1");
    c.signal(victim, "KILL");
    wait_for("the lost column rebuilt elsewhere", HEAL, || {
        let v = c.try_json(&["volume", "show", "e"])?;
        let columns = nodes_of(&c, "e", "stripe");
        let healthy = v["health"] == "healthy" || v["volume"]["reconfig"].is_null();
        match columns.len() == 3 && !columns.contains(&victim) && healthy {
            true => Ok(()),
            false => Err(components_of(&v)),
        }
    });
    wait_destaged(&c, 1, "e");
    fio_verify_only(&c.uri(1, "e"), "64M");
    // The rebuilt column takes new stripes too.
    finish(fio_write_verify(&c.uri(1, "e"), "64M"));
    wait_destaged(&c, 1, "e");
    fio_verify_only(&c.uri(1, "e"), "64M");
}

/// A raid5 volume on six hosts is 4+1. One host dies for good: after the
/// repair delay the cluster has five usable fault domains, and the
/// volume's caretaker restripes it to 2+1 (lowered to raid1 ftt=1, then
/// raised back to raid5 on the hosts left), while fio's data reads back
/// throughout and after. The volume ends raid5 2+1 with no column on the
/// dead host and nothing more wanted.
#[test]
fn raid5_restripes_from_4_plus_1_to_2_plus_1_when_a_host_is_gone() {
    require("fio");
    let c = Cluster::start_with(6, &["--repair-delay", "3s"]);
    c.create_volume("e", "64M", "raid5");
    let text = c.shoal(&["volume", "show", "e"]);
    assert!(
        text.contains("4+1 stripes over 5 stripe components"),
        "{text}"
    );
    own_from_node1(&c, "e");
    finish(fio_write_verify(&c.uri(1, "e"), "32M"));
    wait_destaged(&c, 1, "e");
    let data = nodes_of(&c, "e", "Data");
    let victim = *nodes_of(&c, "e", "stripe")
        .iter()
        .find(|n| **n != 1 && !data.contains(n))
        .expect("a column's host holding no copy");
    c.signal(victim, "KILL");
    let narrow = wait_for("restriped to 2+1", LOAD, || {
        let v = c.try_json(&["volume", "show", "e"])?;
        let vol = &v["volume"];
        let done = vol["policy"]["layout"] == "Raid5"
            && vol["stripe"]["data"] == 2
            && vol["reconfig"].is_null()
            && vol["wanted_policy"].is_null();
        match done {
            true => Ok(v),
            false => Err(components_of(&v)),
        }
    });
    let columns = nodes_of(&c, "e", "stripe");
    assert_eq!(columns.len(), 3, "{narrow}");
    assert!(!columns.contains(&victim), "{narrow}");
    assert!(
        whole_logs(&c).contains("restripe of volume e to 2+1 begun"),
        "no restripe in the logs"
    );
    // The raised volume's owner starts with the next I/O (as after any
    // change of kind): read through node 1, which then owns it and
    // destages every block into 2+1 stripes.
    fio_verify_only(&c.uri(1, "e"), "32M");
    wait_destaged(&c, 1, "e");
    let reader = (2..=6).find(|n| *n != victim).expect("a node");
    fio_verify_only(&c.uri(reader, "e"), "32M");
}

/// `capacity` of `vol` from `volume show --json`: (size, written, used).
fn capacity(c: &Cluster, vol: &str) -> (u64, u64, u64) {
    let v = c.json(&["volume", "show", vol]);
    let cap = &v["capacity"];
    let field = |k: &str| {
        cap[k]
            .as_u64()
            .unwrap_or_else(|| panic!("capacity.{k}: {v}"))
    };
    (
        field("size_bytes"),
        field("written_bytes"),
        field("used_bytes"),
    )
}

/// What each policy takes on the devices, as `volume show` and `shoal
/// status` report it: a raid1 ftt=1 volume written whole once takes twice
/// its data; a raid5 one (2+1 stripes) at most 1.6 times once destaged.
#[test]
fn capacity_shows_what_each_policy_takes_on_the_devices() {
    require("qemu-io");
    let c = Cluster::start_sized(4, "1G", &[]);
    for (vol, policy) in [("m", "raid1 ftt=1"), ("e", "raid5")] {
        c.create_volume(vol, "64M", policy);
        sh(&format!(
            "qemu-io -f raw -c 'write -P 9 0 64M' -c flush {}",
            c.uri(1, vol)
        ));
    }
    wait_destaged(&c, 1, "e");
    let mib = 1u64 << 20;
    assert_eq!(capacity(&c, "m"), (64 * mib, 64 * mib, 128 * mib));
    // The owner counts the written blocks once a tick.
    let (size, written, used) = wait_for("raid5 written bytes counted", HEAL, || {
        match capacity(&c, "e") {
            (s, w, u) if w == 64 * mib => Ok((s, w, u)),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(size, 64 * mib);
    let overhead = used as f64 / written as f64;
    assert!(
        (1.5..=1.6).contains(&overhead),
        "raid5 2+1 takes {overhead:.3}x"
    );
    let text = c.shoal(&["volume", "show", "e"]);
    assert!(
        text.contains("capacity    64 MiB; 64 MiB written;"),
        "{text}"
    );
    let st = c.json(&["status"]);
    assert_eq!(st["capacity"]["written_bytes"], 128 * mib, "{st}");
    assert_eq!(st["capacity"]["used_bytes"], 128 * mib + used, "{st}");
    let text = c.shoal(&["status"]);
    assert!(
        text.contains("volumes in all: 128 MiB; 128 MiB written;"),
        "{text}"
    );
    eprintln!("raid5 2+1: {overhead:.3}x the data written on the devices");
}

/// A raid1 ftt=1 volume becomes raid5 while fio writes and verifies it:
/// the change adds a capacity leg (the copies stay, as its performance
/// leg), commits, the volume's owner restarts as an erasure-coded one and
/// destages everything; the data reads back, and the volume takes less
/// than the mirror's twice its data. The way back is refused, with why.
#[test]
fn raid1_becomes_raid5_under_fio_verify() {
    require("fio");
    let c = Cluster::start(4);
    c.create_volume("p", "64M", "raid1 ftt=1");
    own_from_node1(&c, "p");
    let copies = nodes_of(&c, "p", "Data");
    let fio = fio_write_verify(&c.uri(2, "p"), "64M");
    c.wait_metric(&[2], "shoal_nbd_writes_total", WRITES_BEFORE_FAULT, HEAL);
    let out = c.shoal(&[
        "volume",
        "set-policy",
        "p",
        "--policy",
        "raid5 ftt=1",
        "--wait",
        "--timeout",
        "5m",
    ]);
    assert!(out.contains("committed"), "{out}");
    assert!(out.contains("add  stripe 0"), "{out}");
    assert!(out.contains("destages every block to stripes"), "{out}");
    finish(fio);
    let text = c.shoal(&["volume", "show", "p"]);
    assert!(
        text.contains("2+1 stripes over 3 stripe components"),
        "{text}"
    );
    assert_eq!(nodes_of(&c, "p", "Data"), copies, "{text}");
    let owner = c.json(&["volume", "show", "p"])["volume"]["owner"]
        .as_u64()
        .expect("an owner") as u32;
    wait_destaged(&c, owner, "p");
    fio_verify_only(&c.uri(3, "p"), "64M");
    let (_, written, used) = wait_for("raid5 written bytes counted", HEAL, || {
        match capacity(&c, "p") {
            (s, w, u) if w == 64 << 20 => Ok((s, w, u)),
            other => Err(format!("{other:?}")),
        }
    });
    // Less than the mirror's 2x; more than a whole-volume write's 1.57x
    // (a stripe destaged when fio paused is partly filled until the
    // cleaner needs its slot).
    let overhead = used as f64 / written as f64;
    assert!(
        overhead < 2.0,
        "raid5 2+1 after the change takes {overhead:.3}x"
    );
    eprintln!("raid5 2+1 after the change: {overhead:.3}x");
}

/// Every node's whole log, without colour codes.
fn whole_logs(c: &Cluster) -> String {
    (1..=6)
        .map(|n| c.node_dir(n).join("node.log"))
        .map(|p| std::fs::read_to_string(p).unwrap_or_default())
        .map(|t| strip_ansi(&t))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `text` without its terminal colour codes (the nodes' logs have them).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            // ESC [ ... m
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}

/// `set-policy --wait` to `policy` while fio writes and verifies the
/// whole of `vol` through node 2 (its `round`-th pass): the change ends
/// committed, fio finds no error, and node 3 reads the same data back.
/// Answers what `set-policy` printed.
fn change_under_fio_verify(c: &Cluster, vol: &str, policy: &str, round: u64) -> String {
    let fio = fio_write_verify(&c.uri(2, vol), "32M");
    // Part of this pass written (8,192 blocks a pass) before the change.
    c.wait_metric(&[2], "shoal_nbd_writes_total", round * 8192 + 2048, HEAL);
    let out = c.shoal(&[
        "volume",
        "set-policy",
        vol,
        "--policy",
        policy,
        "--wait",
        "--timeout",
        "5m",
    ]);
    assert!(out.contains("committed"), "{out}");
    finish(fio);
    fio_verify_only(&c.uri(3, vol), "32M");
    out
}

/// raid1 -> raid5 -> raid6 -> raid1 on six hosts, each change under fio
/// verify: raid5 to raid6 and raid6 to raid1 go through RAID-1 step by
/// step (the stripes read back to the copies, the ftt changed, a new
/// capacity leg destaged), and the volume ends a mirror again, its stripe
/// components gone from the layout and from their nodes.
#[test]
fn raid1_to_raid5_to_raid6_and_back_to_raid1_under_fio_verify() {
    require("fio");
    let c = Cluster::start(6);
    c.create_volume("p", "32M", "raid1 ftt=1");
    own_from_node1(&c, "p");
    change_under_fio_verify(&c, "p", "raid5 ftt=1", 0);
    let text = c.shoal(&["volume", "show", "p"]);
    assert!(text.contains("4+1 stripes"), "{text}");
    let out = change_under_fio_verify(&c, "p", "raid6 ftt=2", 1);
    assert!(
        out.contains(
            "in 3 steps, each committed before the next: raid1 ftt=1 -> raid1 ftt=2 -> raid6 ftt=2"
        ),
        "{out}"
    );
    assert!(
        out.contains("reads every block the stripes hold back"),
        "{out}"
    );
    let text = c.shoal(&["volume", "show", "p"]);
    assert!(
        text.contains("4+2 stripes over 6 stripe components"),
        "{text}"
    );
    assert_eq!(nodes_of(&c, "p", "Data").len(), 3, "{text}");
    let owner = c.json(&["volume", "show", "p"])["volume"]["owner"]
        .as_u64()
        .expect("an owner") as u32;
    wait_destaged(&c, owner, "p");
    fio_verify_only(&c.uri(4, "p"), "32M");
    let v = c.json(&["volume", "show", "p"]);
    let columns: Vec<u64> = v["volume"]["components"]
        .as_array()
        .expect("components")
        .iter()
        .filter(|x| x["role"].get("Stripe").is_some())
        .map(|x| x["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(columns.len(), 6, "{v}");
    let out = change_under_fio_verify(&c, "p", "raid1 ftt=1", 2);
    assert!(out.contains("raid1 ftt=2 -> raid1 ftt=1"), "{out}");
    let v = c.json(&["volume", "show", "p"]);
    assert_eq!(v["volume"]["stripe"], serde_json::Value::Null, "{v}");
    assert!(nodes_of(&c, "p", "stripe").is_empty(), "{v}");
    assert_eq!(nodes_of(&c, "p", "Data").len(), 2, "{v}");
    // The columns leave their nodes too.
    wait_for("stripe components deleted from their nodes", HEAL, || {
        let logs = whole_logs(&c);
        let deleted = |id: &u64| {
            let field = format!("component={id} ");
            logs.lines().any(|l| {
                l.contains("removing a component the directory no longer lists")
                    && l.contains(&field)
            })
        };
        let left: Vec<u64> = columns.iter().copied().filter(|id| !deleted(id)).collect();
        match left.is_empty() {
            true => Ok(()),
            false => Err(format!("{left:?}")),
        }
    });
    fio_verify_only(&c.uri(5, "p"), "32M");
    // Each change of kind (RAID-1 <-> erasure-coded) restarted the owner
    // on its node, which started the next without waiting out the
    // previous one's read lease: it had ended in the same process.
    // (No node restarts here: every owner started without waiting is one
    // that followed its own on the node.)
    let logs = whole_logs(&c);
    let restarts = logs
        .matches("layout changed kind: its owner restarts")
        .count();
    let unwaited = logs.matches("ran in this process and has stopped").count();
    assert!(
        restarts >= 2 && unwaited >= restarts,
        "{restarts} restarts, {unwaited} without waiting"
    );
}

/// The regions of the growth test: the volume is created with one and
/// grows by one at a time.
const REGION: u64 = 64 << 20;

/// fio's arguments for region `region` of `uri`: every 64 KiB block of it
/// once, in an order fio repeats, with crc32c verify headers (bigger
/// blocks than `common::fio`'s 4 KiB: a region is 64 MiB and the test
/// passes over it several times).
fn fio_region_args(uri: &str, region: u64) -> Vec<String> {
    [
        "--name=g".to_string(),
        "--ioengine=nbd".to_string(),
        format!("--uri={uri}"),
        "--rw=randwrite".to_string(),
        "--bs=64k".to_string(),
        "--iodepth=8".to_string(),
        format!("--offset={}", region * REGION),
        format!("--size={REGION}"),
        "--verify=crc32c".to_string(),
        "--verify_fatal=1".to_string(),
        "--verify_state_save=0".to_string(),
        "--output-format=json".to_string(),
    ]
    .into()
}

/// Writes region `region` of `uri` whole with fio verify data and reads
/// it back.
fn write_region(uri: &str, region: u64) {
    let child = Command::new("fio")
        .args(fio_region_args(uri, region))
        .arg("--do_verify=1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting fio");
    finish(child);
}

/// Checks that regions `0..regions` of `uri` still hold what
/// [`write_region`] wrote there (fio's verify pass alone).
fn verify_regions(uri: &str, regions: u64) {
    for region in 0..regions {
        let out = ok(Command::new("fio")
            .args(fio_region_args(uri, region))
            .arg("--verify_only"));
        assert_fio_clean(&out, false);
    }
}

/// Checks that region `region` of `vol` reads as zeros through a new NBD
/// connection to node `node` (never written: nothing of what the map log
/// left there before a growth shows through).
fn assert_region_zeros(c: &Cluster, node: u32, vol: &str, region: u64) {
    let mut s = connect(&c.nbd_addr(node), vol);
    let chunk = 1u32 << 20;
    let start = region * REGION;
    for offset in (start..start + REGION).step_by(chunk as usize) {
        let (e, got) = ask(&mut s, Nbd::Read, offset, chunk, &[]);
        assert_eq!(e, 0, "reading {vol} at {offset} through node {node}");
        if let Some(at) = got.iter().position(|&b| b != 0) {
            panic!(
                "{vol}: byte {} of region {region}, never written, reads {:#x}, not zero",
                offset + at as u64,
                got[at]
            );
        }
    }
}

/// The size a new NBD connection to node `node` sees of `vol`
/// (`nbdinfo --size`).
fn export_size(c: &Cluster, node: u32, vol: &str) -> Result<u64, String> {
    let out = run(Command::new("timeout")
        .args(["20", "nbdinfo", "--size"])
        .arg(c.uri(node, vol)));
    let text = String::from_utf8_lossy(&out.stdout);
    match out.status.success() {
        true => text
            .trim()
            .parse()
            .map_err(|e| format!("nbdinfo --size said {text:?}: {e}")),
        false => Err(format!(
            "nbdinfo --size on node {node}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// Waits until a new NBD connection to every node of `nodes` sees `vol`
/// at `size` bytes (each node's directory has the commit of the growth).
fn wait_export_size(c: &Cluster, nodes: &[u32], vol: &str, size: u64) {
    wait_for(&format!("{vol} exported at {size} bytes"), HEAL, || {
        for &n in nodes {
            match export_size(c, n, vol)? {
                s if s == size => {}
                s => return Err(format!("node {n} exports {s} bytes")),
            }
        }
        Ok(())
    });
}

/// Waits until `vol` has an owner other than `gone` (killed); that owner.
fn wait_new_owner(c: &Cluster, vol: &str, gone: u32) -> u32 {
    wait_for(
        &format!("a new owner of {vol} (not node {gone})"),
        HEAL,
        || {
            let v = c.try_json(&["volume", "show", vol])?;
            match v["volume"]["owner"].as_u64() {
                Some(o) if o != u64::from(gone) => Ok(o as u32),
                o => Err(format!("owner {o:?}; {}", components_of(&v))),
            }
        },
    )
}

/// A `shoal` command started in the background against node `node`'s API
/// (`--api`), not waited for; killed, if it still runs, when dropped (a
/// test that fails leaves none behind).
struct Background(Option<Child>);

impl Background {
    fn shoal(c: &Cluster, node: u32, args: &[&str]) -> Background {
        let child = c
            .cmd()
            .args(args)
            .args(["--api", &c.api(node)])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting shoal {args:?}: {e}"));
        Background(Some(child))
    }

    /// Panics with its output if it has ended with a failure.
    fn check_not_failed(&mut self) {
        let child = self.0.as_mut().expect("a running command");
        if let Ok(Some(status)) = child.try_wait() {
            if !status.success() {
                let out = self.0.take().expect("it").wait_with_output();
                let out = out.expect("its output");
                panic!(
                    "background shoal failed: {status}\nstdout:\n{}\nstderr:\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }

    /// Waits at most `timeout` for it to end, and for success; its stdout.
    fn finish(mut self, what: &str, timeout: Duration) -> String {
        wait_for(what, timeout, || {
            let child = self.0.as_mut().expect("a running command");
            match child.try_wait() {
                Ok(Some(_)) => Ok(()),
                Ok(None) => Err("still running".to_string()),
                Err(e) => Err(e.to_string()),
            }
        });
        let out = self.0.take().expect("it").wait_with_output();
        let out = out.expect("its output");
        assert!(
            out.status.success(),
            "{what}: {}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Polls `volume show` of `vol` as fast as it answers (not
/// [`wait_for`]'s backing off: a growth takes moments) until it shows a
/// growth to `to` in progress or already committed; that JSON. `resize`,
/// the command that asked for it, must not have failed meanwhile.
fn catch_growth(c: &Cluster, vol: &str, to: u64, resize: &mut Background) -> serde_json::Value {
    let deadline = Instant::now() + LOAD;
    loop {
        let last = match c.try_json(&["volume", "show", vol]) {
            Ok(v) if v["volume"]["grow_to"] == to || v["volume"]["size"] == to => return v,
            Ok(v) => v.to_string(),
            Err(e) => e,
        };
        resize.check_not_failed();
        assert!(
            Instant::now() < deadline,
            "{vol} growing to {to}: not after {LOAD:?} (last: {last})"
        );
    }
}

/// What is refused of `vol` while it is being grown from `old` to `to`
/// bytes with its owner just killed -9 (no new owner ends the growth for
/// some seconds: the directory finds the node down first), and what a new
/// NBD connection to node `node` sees meanwhile: the old size. Each claim
/// is checked strictly if the growth was still in progress after it (a
/// later `volume show` still has `grow_to`).
fn while_growing(c: &Cluster, vol: &str, node: u32, old: u64, to: u64) {
    // A policy change that would begin (a lowering to raid1) if the volume
    // were not being grown.
    let policy = c.shoal_fails(&["volume", "set-policy", vol, "--policy", "raid1 ftt=1"]);
    assert!(policy.contains("being grown"), "set-policy: {policy}");
    // Between the old size and the new: a second growth, to another size.
    let between = ((old + to) / 2).to_string();
    let resize = c.shoal_fails(&["volume", "resize", vol, "--size", &between]);
    let size = export_size(c, node, vol);
    let v = c.json(&["volume", "show", vol]);
    if v["volume"]["grow_to"] == to {
        assert!(resize.contains("being grown"), "resize: {resize}");
        assert_eq!(size, Ok(old), "a new connection during the growth");
        assert_eq!(v["volume"]["size"], old, "{v}");
    } else {
        eprintln!("the growth of {vol} was committed during the checks: {v}");
        assert!(
            resize.contains("being grown") || resize.contains("cannot shrink"),
            "resize: {resize}"
        );
    }
}

/// A raid5 volume of 64 MiB, written whole by fio with verify data and
/// destaged, grows to 128 MiB (`shoal volume resize` returns once the size
/// is committed): the first 64 MiB verify, the new region reads as zeros
/// and takes fio's writes, through new NBD connections that see the new
/// size. Its owner is killed -9: the next owner serves both regions. Then
/// it grows to 192 MiB with its owner stopped before the growth is
/// recorded, then killed -9 (in progress: the set-policy and another
/// resize meanwhile are refused, new connections see the old size): the
/// next owner carries out the growth, the command returns, and
/// everything written verifies, the new region zeros until fio writes it
/// too.
#[test]
fn raid5_grows_under_fio_verify_and_through_a_kill_of_its_owner() {
    require("fio");
    require("nbdinfo");
    require("qemu-io");
    let c = Cluster::start(4);
    let all: Vec<u32> = (1..=4).collect();
    c.create_volume("g", "64M", "raid5");
    // The owner on a node with a copy of the performance leg: killed, it
    // takes a copy down, so the volume's caretaker claims it again
    // without client I/O.
    let owner = nodes_of(&c, "g", "Data")[0];
    own_from(&c, "g", owner);
    write_region(&c.uri(owner, "g"), 0);
    wait_destaged(&c, owner, "g");

    // b. Grown to 128 MiB: committed when the command returns.
    c.shoal(&["volume", "resize", "g", "--size", "128M"]);
    let v = c.json(&["volume", "show", "g"]);
    assert_eq!(v["volume"]["size"], 2 * REGION, "{v}");
    assert!(v["volume"]["grow_to"].is_null(), "{v}");

    // c. New connections see 128 MiB; the old data verifies; the new
    // region reads as zeros, then takes writes, through another node.
    wait_export_size(&c, &all, "g", 2 * REGION);
    let other = *all.iter().find(|&&n| n != owner).expect("another node");
    verify_regions(&c.uri(other, "g"), 1);
    assert_region_zeros(&c, other, "g", 1);
    write_region(&c.uri(other, "g"), 1);
    let owner = owner_of(&c, "g");
    wait_destaged(&c, owner, "g");

    // d. The owner killed -9: a new one serves both regions.
    c.signal(owner, "KILL");
    let next = wait_new_owner(&c, "g", owner);
    c.up();
    c.wait_healthy("g", HEAL);
    wait_destaged(&c, next, "g");
    verify_regions(&c.uri(owner, "g"), 2);

    // e. Grown to 192 MiB with the owner stopped (SIGSTOP) before the
    // growth is recorded, then killed -9: the next owner carries out the
    // whole growth, and the command returns.
    let victim = owner_of(&c, "g");
    let api = *all.iter().find(|&&n| n != victim).expect("another node");
    c.signal(victim, "STOP");
    let mut resize = Background::shoal(&c, api, &["volume", "resize", "g", "--size", "192M"]);
    let seen = catch_growth(&c, "g", 3 * REGION, &mut resize);
    assert_eq!(seen["volume"]["grow_to"], 3 * REGION, "{seen}");
    assert_eq!(seen["volume"]["size"], 2 * REGION, "{seen}");
    c.signal(victim, "KILL");
    let reader = *all.iter().find(|&&n| n != victim).expect("a live node");
    // Still in progress once its owner is dead (it may have committed
    // between that look and the kill): nothing ends it for a few seconds.
    let now = c.json(&["volume", "show", "g"]);
    if now["volume"]["grow_to"] == 3 * REGION {
        while_growing(&c, "g", reader, 2 * REGION, 3 * REGION);
    } else {
        eprintln!("the growth to 192M was committed before the kill: {now}");
    }
    wait_for(
        "the growth to 192M committed by the next owner",
        HEAL,
        || {
            let v = c.try_json(&["volume", "show", "g"])?;
            match v["volume"]["size"] == 3 * REGION && v["volume"]["grow_to"].is_null() {
                true => Ok(()),
                false => Err(format!(
                    "size {}, grow_to {}, owner {}",
                    v["volume"]["size"], v["volume"]["grow_to"], v["volume"]["owner"]
                )),
            }
        },
    );
    resize.finish("shoal volume resize g --size 192M", LOAD);
    // Read with the killed node still down (a stripe column may be out:
    // degraded reads).
    let live: Vec<u32> = all.iter().copied().filter(|&n| n != victim).collect();
    wait_export_size(&c, &live, "g", 3 * REGION);
    verify_regions(&c.uri(reader, "g"), 2);
    assert_region_zeros(&c, reader, "g", 2);
    c.up();
    c.wait_healthy("g", HEAL);
    wait_export_size(&c, &all, "g", 3 * REGION);
    write_region(&c.uri(victim, "g"), 2);
    wait_destaged(&c, owner_of(&c, "g"), "g");
    verify_regions(&c.uri(reader, "g"), 3);
}
