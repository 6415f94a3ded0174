//! Bit rot on the device files of a local cluster: finding a block's
//! bytes in a device file, flipping one of its bits, and waiting for the
//! nodes' scrub passes.

use super::{wait_for, Cluster};
use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;

const MIB: usize = 1 << 20;
const BLOCK: usize = 4096;

/// Waits until every node in `nodes` finished `passes` scrub passes.
pub fn wait_scrub_passes(c: &Cluster, nodes: &[u32], passes: u64) {
    wait_for(
        &format!("{passes} scrub passes on every node"),
        Duration::from_secs(60),
        || {
            for &n in nodes {
                let r: serde_json::Value =
                    serde_json::from_str(&c.rest(n, "/v1/scrub", &[])).expect("scrub json");
                let done = r["passes"].as_u64().unwrap_or(0);
                if done < passes {
                    return Err(format!("node {n}: {done} passes"));
                }
            }
            Ok(())
        },
    );
}

/// Device id -> device file path, from `shoal status`.
pub fn device_paths(c: &Cluster) -> HashMap<u64, PathBuf> {
    let status = c.json(&["status"]);
    status["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .map(|d| {
            (
                d["id"].as_u64().expect("device id"),
                PathBuf::from(d["path"].as_str().expect("device path")),
            )
        })
        .collect()
}

/// Byte offsets in the device file of every 4 KiB block equal to `block`.
pub fn find_blocks(path: &PathBuf, block: &[u8]) -> Vec<u64> {
    let mut f = std::fs::File::open(path).expect("device file");
    let mut buf = vec![0u8; 4 * MIB];
    let (mut base, mut found) = (0u64, Vec::new());
    loop {
        let mut got = 0;
        while got < buf.len() {
            match f.read(&mut buf[got..]).expect("reading the device file") {
                0 => break,
                n => got += n,
            }
        }
        if got == 0 {
            return found;
        }
        for (i, b) in buf[..got].chunks(BLOCK).enumerate() {
            if b == block {
                found.push(base + (i * BLOCK) as u64);
            }
        }
        base += got as u64;
    }
}

/// Byte offset in the device file of the first 4 KiB block equal to
/// `block`.
pub fn find_block(path: &PathBuf, block: &[u8]) -> u64 {
    *find_blocks(path, block)
        .first()
        .unwrap_or_else(|| panic!("block not found in {}", path.display()))
}

/// Flips one bit of the block at `at` in the device file, durably.
pub fn flip_bit(path: &PathBuf, at: u64) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("device file");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at + 1234).expect("read");
    b[0] ^= 0x10;
    f.write_all_at(&b, at + 1234).expect("write");
    f.sync_all().expect("sync");
}
