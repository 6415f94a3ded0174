//! Device faults on real node processes: a device that starts answering
//! I/O errors (nbdkit's error filter behind a FUSE file, `nbdfuse`), and a
//! device that fills up.

mod common;

use common::fio::{finish, fio_verify_only, fio_write_verify};
use common::{holds_for, poll_for, require, sh, wait_for, Cluster};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A file served by nbdkit's `file` plugin through its `error` filter and
/// mounted as a regular file with `nbdfuse`: every request fails with EIO
/// while the trigger file exists.
struct FaultyDevice {
    dir: tempfile::TempDir,
    nbdfuse: Option<Child>,
    file: PathBuf,
    trigger: PathBuf,
}

impl FaultyDevice {
    fn start(size: &str) -> FaultyDevice {
        require("nbdfuse");
        require("nbdkit");
        require("fusermount3");
        let dir = tempfile::Builder::new()
            .prefix("shoal-faulty")
            .tempdir()
            .expect("tempdir");
        let backing = dir.path().join("backing.img");
        let mnt = dir.path().join("mnt");
        let trigger = dir.path().join("trigger");
        std::fs::create_dir(&mnt).expect("mount point");
        sh(&format!("truncate -s {size} {}", backing.display()));
        let file = mnt.join("dev");
        let child = Command::new("nbdfuse")
            .arg(&file)
            .args([
                "[",
                "nbdkit",
                "--exit-with-parent",
                "--filter=error",
                "file",
            ])
            .arg(&backing)
            .arg("error-rate=100%")
            .arg(format!("error-file={}", trigger.display()))
            .arg("]")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nbdfuse");
        let d = FaultyDevice {
            dir,
            nbdfuse: Some(child),
            file,
            trigger,
        };
        wait_for(
            "nbdfuse mounting the file",
            Duration::from_secs(20),
            || match std::fs::metadata(&d.file).map(|m| m.len()) {
                Ok(n) if n > 0 => Ok(()),
                r => Err(format!("{r:?}")),
            },
        );
        d
    }

    /// From now on every request to the device fails with EIO.
    fn fail(&self) {
        std::fs::write(&self.trigger, b"").expect("creating the trigger");
    }

    fn heal(&self) {
        std::fs::remove_file(&self.trigger).expect("removing the trigger");
    }

    fn mount_point(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }
}

impl Drop for FaultyDevice {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.trigger);
        let mnt = self.mount_point();
        // Clean-up must not panic: poll, then force.
        let unmounted = poll_for(Duration::from_secs(5), || {
            match Command::new("fusermount3").arg("-u").arg(&mnt).output() {
                Ok(o) if o.status.success() => Ok(()),
                r => Err(format!("{r:?}")),
            }
        });
        if unmounted.is_err() {
            let _ = Command::new("fusermount3").arg("-uz").arg(&mnt).output();
        }
        if let Some(mut c) = self.nbdfuse.take() {
            let exited = poll_for(Duration::from_secs(5), || match c.try_wait() {
                Ok(Some(_)) => Ok(()),
                r => Err(format!("{r:?}")),
            });
            if exited.is_err() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// The nodes holding data copies of a volume.
fn data_nodes(c: &Cluster, vol: &str) -> Vec<u32> {
    components(c, vol)
        .iter()
        .filter(|x| x["role"] == "Data")
        .map(|x| x["node"].as_u64().expect("node") as u32)
        .collect()
}

fn components(c: &Cluster, vol: &str) -> Vec<serde_json::Value> {
    c.json(&["volume", "show", vol])["volume"]["components"]
        .as_array()
        .expect("components")
        .clone()
}

/// State of the data component of `vol` on `node` ("Active", "Degraded", ...).
fn component_state(c: &Cluster, vol: &str, node: u32) -> String {
    components(c, vol)
        .iter()
        .find(|x| x["role"] == "Data" && x["node"] == node)
        .and_then(|x| x["state"].as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no data component of {vol} on node {node}"))
}

/// The device of `node` as `shoal status --json` shows it.
fn device_of(c: &Cluster, node: u32) -> serde_json::Value {
    c.json(&["status"])["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .find(|d| d["node"] == node)
        .cloned()
        .unwrap_or_else(|| panic!("no device of node {node} in the status"))
}

fn device_state(c: &Cluster, node: u32) -> String {
    device_of(c, node)["state"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Waits until `shoal status` shows node `node`'s device in `state`.
fn wait_device_state(c: &Cluster, node: u32, state: &str, timeout: Duration) {
    wait_for(
        &format!("the device of node {node} {state}"),
        timeout,
        || match device_state(c, node) {
            s if s == state => Ok(()),
            s => Err(s),
        },
    );
}

fn qemu_io(uri: &str, cmd: &str) -> std::process::Output {
    Command::new("qemu-io")
        .args(["-f", "raw", "-c", cmd, uri])
        .output()
        .expect("running qemu-io")
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A replica's device starts answering EIO to everything in the middle of
/// a fio verify workload: the client sees no error, the copy on it is
/// recorded Degraded, the device Failed, and every block reads back from
/// the surviving copy.
#[test]
fn device_io_errors_degrade_the_copy_and_fail_the_device() {
    io_errors_during_fio(1);
}

/// The same with the faulty device under the owner's own copy: the
/// client's node owns the volume and loses its local copy.
#[test]
fn owner_device_io_errors_degrade_its_own_copy() {
    io_errors_during_fio(2);
}

/// Node 2's device fails during fio through node `client` (which becomes
/// the owner).
fn io_errors_during_fio(client: u32) {
    require("fio");
    require("qemu-io");
    let dev = FaultyDevice::start("512M");
    let c = Cluster::start_sized(
        3,
        "512M",
        &["--node-device", &format!("2={}", path_str(&dev.file))],
    );
    c.create_volume("v", "256M", "raid1 ftt=1");
    let data = data_nodes(&c, "v");
    assert!(
        data.contains(&2),
        "placement must put a data copy on node 2 (the faulty device): {data:?}"
    );
    assert_eq!(device_state(&c, 2), "Healthy");

    // The client's node becomes the owner.
    let fio = fio_write_verify(&c.uri(client, "v"), "96M");
    // The fault comes once the client's node served 16 MiB of the 96 MiB
    // of writes.
    c.wait_metric(
        &[client],
        "shoal_nbd_writes_total",
        4096,
        Duration::from_secs(60),
    );
    let mut fio = Some(fio);
    if let Some(f) = fio.as_mut() {
        assert!(
            f.try_wait().expect("fio status").is_none(),
            "fio finished before the fault: the test would prove nothing"
        );
    }
    dev.fail();
    // Failed is reported by the node's heartbeats once its store answered
    // an I/O error; watch for it while fio runs.
    let (failed_after, degraded_after) = std::thread::scope(|s| {
        let watch = s.spawn(|| {
            let t0 = Instant::now();
            c.wait_component_state("v", 2, "Degraded", Duration::from_secs(60));
            let degraded = t0.elapsed();
            wait_device_state(&c, 2, "Failed", Duration::from_secs(60));
            (t0.elapsed(), degraded)
        });
        if let Some(f) = fio.take() {
            finish(f);
        }
        watch.join().expect("watcher")
    });
    eprintln!(
        "after the fault: component Degraded within {degraded_after:?}, \
         device Failed within {failed_after:?}"
    );
    assert_ne!(c.health("v"), "healthy");
    assert_eq!(component_state(&c, "v", 1), "Active");
    assert_eq!(
        c.json(&["volume", "show", "v"])["volume"]["owner"].as_u64(),
        Some(client as u64)
    );

    // A failed device takes no new components: with it, three nodes no
    // longer make the three fault domains a raid1 ftt=1 volume needs.
    let e = c.shoal_fails(&[
        "volume",
        "create",
        "w",
        "--size",
        "64M",
        "--policy",
        "raid1 ftt=1",
    ]);
    assert!(e.contains("fault domains"), "{e}");

    // Writes keep working on the surviving copy.
    let out = qemu_io(&c.uri(client, "v"), "write -P 0x6b 200M 1M");
    assert!(
        out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("failed"),
        "write after the fault: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // The device stays failed when its errors stop: its store stopped
    // after a failed write and is not trusted until reopened. That nothing
    // changes can only be watched for a while: four heartbeats of node 2
    // (one every 500 ms), each of which could report the device again.
    dev.heal();
    holds_for(
        "the healed device still Failed",
        Duration::from_secs(2),
        || match device_state(&c, 2) {
            s if s == "Failed" => Ok(()),
            s => Err(s),
        },
    );

    // Everything reads back from the surviving copy, through every node.
    fio_verify_only(&c.uri(3, "v"), "96M");
    fio_verify_only(&c.uri(2, "v"), "96M");
    let out = qemu_io(&c.uri(3, "v"), "read -P 0x6b 200M 1M");
    assert!(
        out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("fail"),
        "read back: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if std::env::var("SHOAL_TEST_LOGS").is_ok() {
        eprintln!("{}", c.logs());
    }
}

/// Runs one qemu-io command; `Ok(stdout)` when it succeeded, `Err(all
/// output)` when qemu-io reported a failure.
fn qemu_io_cmd(uri: &str, cmd: &str) -> Result<String, String> {
    let out = qemu_io(uri, cmd);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() && !stdout.contains("failed") && !stderr.contains("failed") {
        Ok(stdout)
    } else {
        Err(format!("{stdout}{stderr}"))
    }
}

fn qemu_io_ok(uri: &str, cmd: &str) {
    if let Err(e) = qemu_io_cmd(uri, cmd) {
        panic!("qemu-io {cmd:?} on {uri} failed: {e}");
    }
}

/// A thin volume larger than its (small) devices is written until they
/// fill: the client gets ENOSPC (not EIO), the devices are shown Full,
/// what was written before reads back intact, and after a discard the
/// volume takes writes again and the devices are Healthy.
#[test]
fn full_device_gives_enospc_and_recovers_after_discard() {
    require("qemu-io");
    let c = Cluster::start_sized(3, "64M", &[]);
    c.create_volume("v", "128M", "raid1 ftt=1");
    let data = data_nodes(&c, "v");
    assert_eq!(data.len(), 2, "{data:?}");
    let capacity = device_of(&c, data[0])["capacity"]
        .as_u64()
        .expect("capacity");
    assert!(
        capacity < 128 << 20,
        "the volume must be larger than a device: {capacity}"
    );
    let uri = c.uri(1, "v");
    let pattern = |mib: u64| 0x40 + (mib % 64);

    // Fill 1 MiB at a time, each with its own pattern, until refused.
    let mut refused_at = None;
    for mib in 0..128u64 {
        match qemu_io_cmd(&uri, &format!("write -P {} {mib}M 1M", pattern(mib))) {
            Ok(_) => {}
            Err(e) => {
                assert!(
                    e.contains("No space left on device"),
                    "a full device must give ENOSPC, got: {e}"
                );
                refused_at = Some(mib);
                break;
            }
        }
    }
    let full = refused_at.expect("writing twice the device's capacity must hit ENOSPC");
    eprintln!("ENOSPC at {full} MiB (device capacity {capacity} bytes)");
    assert!(
        full * (1 << 20) + (1 << 20) >= capacity,
        "ENOSPC after only {full} MiB of {capacity} bytes"
    );
    // Writes keep failing the same way (no EIO, no hang).
    let e = qemu_io_cmd(&uri, &format!("write -P 1 {}M 1M", full + 1))
        .expect_err("a write past the capacity must fail");
    assert!(e.contains("No space left on device"), "{e}");

    // The devices holding the copies are shown full; the witness is not.
    for &n in &data {
        wait_device_state(&c, n, "Full", Duration::from_secs(30));
    }
    let witness = (1..=3).find(|n| !data.contains(n)).expect("witness node");
    assert_eq!(device_state(&c, witness), "Healthy");
    // ENOSPC is not a device failure: the copies stay in sync.
    assert_eq!(c.health("v"), "healthy");
    // Full devices take no new volumes.
    let e = c.shoal_fails(&[
        "volume",
        "create",
        "w",
        "--size",
        "64M",
        "--policy",
        "raid1 ftt=1",
    ]);
    assert!(e.contains("fault domains"), "{e}");

    // Nothing written before is damaged, through another node too.
    for mib in 0..full {
        qemu_io_ok(
            &c.uri(3, "v"),
            &format!("read -P {} {mib}M 1M", pattern(mib)),
        );
    }
    c.verify_copies("v");

    // Discard half of it: the volume takes writes again, the devices are
    // healthy again, and the discarded range reads as zeros.
    let half = full / 2;
    qemu_io_ok(&uri, &format!("discard 0 {half}M"));
    for &n in &data {
        wait_device_state(&c, n, "Healthy", Duration::from_secs(30));
    }
    qemu_io_ok(&uri, &format!("read -P 0 0 {half}M"));
    qemu_io_ok(&uri, &format!("write -P 0x33 {full}M 4M"));
    qemu_io_ok(&c.uri(2, "v"), &format!("read -P 0x33 {full}M 4M"));
    for mib in half..full {
        qemu_io_ok(
            &c.uri(2, "v"),
            &format!("read -P {} {mib}M 1M", pattern(mib)),
        );
    }
    c.wait_healthy("v", Duration::from_secs(30));
    c.verify_copies("v");
}

/// Writes 1 MiB chunks of `vol` from `from` MiB on, each with its own
/// pattern, until the first refusal, which must be ENOSPC. Returns the
/// first refused MiB (None: all `to - from` MiB were taken).
fn fill_until_enospc(uri: &str, from: u64, to: u64, pattern: impl Fn(u64) -> u64) -> Option<u64> {
    for mib in from..to {
        if let Err(e) = qemu_io_cmd(uri, &format!("write -P {} {mib}M 1M", pattern(mib))) {
            assert!(
                e.contains("No space left on device"),
                "a full device must give ENOSPC, got: {e}"
            );
            return Some(mib);
        }
    }
    None
}

/// `reserve=100%`: a reserved volume is created only where its whole size
/// is free, and a thin volume on the same device gets ENOSPC before it
/// eats into that promise, while the reserved volume can still be written
/// in full.
#[test]
fn thin_volumes_cannot_take_space_reserved_for_thick_ones() {
    require("qemu-io");
    let c = Cluster::start_sized(1, "64M", &[]);
    let capacity = device_of(&c, 1)["capacity"].as_u64().expect("capacity");
    let reserved: u64 = 24 << 20;
    c.create_volume("r", "24M", "ftt=0 reserve=100%");
    assert_eq!(
        device_of(&c, 1)["reserved"].as_u64(),
        Some(reserved),
        "{}",
        c.shoal(&["status"])
    );
    // Neither larger than the device, nor larger than what is left.
    let e = c.shoal_fails(&[
        "volume",
        "create",
        "big",
        "--size",
        "64M",
        "--policy",
        "ftt=0 reserve=100%",
    ]);
    assert!(e.contains("space") || e.contains("Space"), "{e}");
    let e = c.shoal_fails(&[
        "volume",
        "create",
        "r2",
        "--size",
        "40M",
        "--policy",
        "ftt=0 reserve=100%",
    ]);
    assert!(e.contains("space") || e.contains("Space"), "{e}");
    assert_eq!(device_of(&c, 1)["reserved"].as_u64(), Some(reserved));
    // A thin volume may be larger than the device.
    c.create_volume("t", "128M", "ftt=0");

    // The thin volume fills what the reservation leaves, not more.
    let tp = |mib: u64| 0x20 + (mib % 32);
    let full = fill_until_enospc(&c.uri(1, "t"), 0, 128, tp)
        .expect("the thin volume must hit ENOSPC on a 64 MiB device");
    let left = capacity - reserved;
    eprintln!("thin volume refused at {full} MiB; capacity {capacity}, reserved {reserved}");
    assert!(
        full << 20 <= left,
        "the thin volume took {full} MiB, more than the {left} bytes left beside the reservation"
    );
    assert!(
        (full + 2) << 20 > left,
        "the thin volume was refused at {full} MiB, well before the {left} bytes left"
    );
    // What is left is promised: the device is shown full.
    wait_device_state(&c, 1, "Full", Duration::from_secs(30));
    // Overwrites of its own data still work.
    qemu_io_ok(&c.uri(1, "t"), "write -P 0x5f 0 1M");
    qemu_io_ok(&c.uri(1, "t"), "read -P 0x5f 0 1M");

    // The reserved volume can be written in full, and reads back.
    let rp = |mib: u64| 0x60 + mib;
    assert_eq!(fill_until_enospc(&c.uri(1, "r"), 0, 24, rp), None);
    for mib in 0..24 {
        qemu_io_ok(&c.uri(1, "r"), &format!("read -P {} {mib}M 1M", rp(mib)));
    }
    for mib in 1..full {
        qemu_io_ok(&c.uri(1, "t"), &format!("read -P {} {mib}M 1M", tp(mib)));
    }
    wait_device_state(&c, 1, "Full", Duration::from_secs(30));

    // Freeing thin data makes room for the thin volume again.
    qemu_io_ok(&c.uri(1, "t"), "discard 0 8M");
    wait_device_state(&c, 1, "Healthy", Duration::from_secs(30));
    qemu_io_ok(&c.uri(1, "t"), &format!("write -P 0x44 {full}M 4M"));
    qemu_io_ok(&c.uri(1, "t"), &format!("read -P 0x44 {full}M 4M"));
}
