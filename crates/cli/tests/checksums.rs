//! Bit rot on a real device file: a flipped bit in a replica's block is
//! detected by the per-block checksum on read, the client still gets the
//! right data from the other copy, and the bad block is repaired from it;
//! the scrubber finds and repairs the bad blocks no client reads.

mod common;

use common::bitrot::{device_paths, find_block, flip_bit, wait_scrub_passes};
use common::*;
use std::path::PathBuf;
use std::time::Duration;

const MIB: usize = 1 << 20;
const BLOCK: usize = 4096;

/// (node, device path) of each data copy of `vol`, and its owner.
fn copies(c: &Cluster, vol: &str) -> (Vec<(u32, PathBuf)>, Option<u32>) {
    let paths = device_paths(c);
    let v = c.json(&["volume", "show", vol]);
    let data = v["volume"]["components"]
        .as_array()
        .expect("components")
        .iter()
        .filter(|x| x["role"] == "Data")
        .map(|x| {
            let node = x["node"].as_u64().expect("node") as u32;
            let dev = x["device"].as_u64().expect("device");
            (node, paths[&dev].clone())
        })
        .collect();
    (data, v["volume"]["owner"].as_u64().map(|o| o as u32))
}

/// Nothing of `vol` is being resynced or rebuilt, as every node and the
/// command line tell, and the metrics agree (`owner`: the owner's node).
fn healed_in_place(c: &Cluster, vol: &str, owner: u32) {
    for n in 1..=3 {
        let v: serde_json::Value =
            serde_json::from_str(&c.rest(n, &format!("/v1/volumes/{vol}"), &[])).expect("json");
        assert!(v["resync"].is_null(), "node {n}: {v}");
        assert_eq!(v["healing"], "healthy", "node {n}: {v}");
    }
    let v = c.json(&["volume", "show", vol]);
    assert!(v["resync"].is_null() && v["healing"] == "healthy", "{v}");
    let text = c.shoal(&["volume", "show", vol]);
    assert!(text.contains("healing     healthy"), "{text}");
    let status = c.shoal(&["status"]);
    let line = status.lines().find(|l| l.starts_with(&format!("{vol} ")));
    assert!(line.is_some_and(|l| l.ends_with(" healthy")), "{status}");
    // Two copies and a witness, each counted on its own node only.
    assert_eq!(c.metric(&[1, 2, 3], "shoal_components"), 3);
    let metrics = c.rest(owner, "/metrics", &[]);
    let left = format!("shoal_volume_resync_bytes_left{{node=\"{owner}\",volume=\"{vol}\"}} 0");
    assert!(metrics.contains(&left), "{metrics}");
    assert!(metrics.contains("shoal_resync_bytes_total{"), "{metrics}");
}

#[test]
fn flipped_bits_are_detected_served_from_the_other_copy_and_repaired() {
    require("nbdcopy");
    require("qemu-io");
    require("curl");
    let c = Cluster::start(3);
    c.create_volume("rot", "64M", "raid1 ftt=1");
    c.wait_healthy("rot", Duration::from_secs(30));
    let (data, _) = copies(&c, "rot");
    assert_eq!(data.len(), 2, "two data copies");
    let (a, b) = (data[0].clone(), data[1].clone());

    // 16 MiB of blocks that are all different, written through the node of
    // copy A, which thereby becomes the owner (reads prefer its own copy).
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("src.img");
    let mut content = vec![0u8; 16 * MIB];
    for (i, blk) in content.chunks_mut(BLOCK).enumerate() {
        for (j, w) in blk.chunks_mut(8).enumerate() {
            let x = ((i as u64) << 32 | j as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            w.copy_from_slice(&x.to_le_bytes());
        }
    }
    std::fs::write(&src, &content).expect("write source");
    sh(&format!(
        "nbdcopy {} {} && qemu-io -f raw -c flush {}",
        src.display(),
        c.uri(a.0, "rot"),
        c.uri(a.0, "rot")
    ));
    assert_eq!(copies(&c, "rot").1, Some(a.0), "owner is copy A's node");
    let nodes: Vec<u32> = (1..=3).collect();
    assert_eq!(c.metric(&nodes, "shoal_device_checksum_errors_total"), 0);

    // Rot: block 100 on copy A (read by clients), block 2000 on copy B
    // (only the scrubber reads it).
    let (ka, kb) = (100usize, 2000usize);
    let at_a = find_block(&a.1, &content[ka * BLOCK..(ka + 1) * BLOCK]);
    let at_b = find_block(&b.1, &content[kb * BLOCK..(kb + 1) * BLOCK]);
    flip_bit(&a.1, at_a);
    flip_bit(&b.1, at_b);

    // A client reading everything through copy A's node gets the right
    // bytes: block 100 fails its checksum there and comes from copy B.
    let back = dir.path().join("back.img");
    sh(&format!("nbdcopy {} {}", c.uri(a.0, "rot"), back.display()));
    let got = std::fs::read(&back).expect("read back");
    assert!(got[..16 * MIB] == content[..], "client read wrong data");
    wait_for("the read-path repair", Duration::from_secs(20), || match c
        .metric(&[a.0], "shoal_device_repaired_blocks_total")
    {
        1 => Ok(()),
        n => Err(format!("{n} blocks repaired")),
    });
    assert!(c.metric(&[a.0], "shoal_device_checksum_errors_total") >= 1);
    // Copy B's bad block was not read yet.
    assert_eq!(c.metric(&[b.0], "shoal_device_repaired_blocks_total"), 0);

    // The scrubber finds it.
    for &n in &nodes {
        c.rest(n, "/v1/scrub", &["-X", "POST"]);
    }
    wait_scrub_passes(&c, &nodes, 1);
    assert_eq!(c.metric(&[b.0], "shoal_scrub_bad_blocks_total"), 1);
    assert_eq!(c.metric(&[b.0], "shoal_device_repaired_blocks_total"), 1);
    assert_eq!(c.metric(&[a.0], "shoal_device_repaired_blocks_total"), 1);
    assert_eq!(c.metric(&nodes, "shoal_scrub_unrepaired_total"), 0);
    assert!(c.metric(&nodes, "shoal_scrub_bytes_total") >= 32 * MIB as u64);

    // Both copies are whole and identical again; a second pass finds
    // nothing; no copy was taken out of service for one bad block.
    c.verify_copies("rot");
    let bad_before = c.metric(&nodes, "shoal_scrub_bad_blocks_total");
    for &n in &nodes {
        c.rest(n, "/v1/scrub", &["-X", "POST"]);
    }
    wait_scrub_passes(&c, &nodes, 2);
    assert_eq!(c.metric(&nodes, "shoal_scrub_bad_blocks_total"), bad_before);
    assert_eq!(c.health("rot"), "healthy");
    healed_in_place(&c, "rot", a.0);
    sh(&format!("nbdcopy {} {}", c.uri(b.0, "rot"), back.display()));
    let got = std::fs::read(&back).expect("read back");
    assert!(got[..16 * MIB] == content[..], "data after repair");
}
