//! Quality of service: a volume's IOPS limit (`iops=N` in its policy,
//! `shoal volume set NAME --iops N`), checked with fio's nbd engine and a
//! client that stays connected while the limit changes.

mod common;

use common::load::ReadLoad;
use common::{require, sh, Cluster};
use std::time::Duration;

/// fio's 4 KiB or 64 KiB random reads at QD32 for `secs`, in the
/// background; `finish_fio` returns the IOPS.
fn fio_randread(uri: &str, bs: &str, secs: u32) -> std::process::Child {
    std::process::Command::new("fio")
        .args([
            "--name=r",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randread",
            &format!("--bs={bs}"),
            "--iodepth=32",
            "--size=96M",
            "--time_based",
            &format!("--runtime={secs}"),
            "--output-format=json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting fio")
}

fn finish_fio(child: std::process::Child) -> f64 {
    let out = child.wait_with_output().expect("fio");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start = text.find('{').expect("fio printed JSON");
    let v: serde_json::Value = serde_json::from_str(&text[start..]).expect("fio JSON");
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "fio reported an error: {text}");
    job["read"]["iops"].as_f64().expect("read IOPS")
}

fn within(what: &str, got: f64, want: f64, tolerance: f64) {
    assert!(
        (got - want).abs() <= want * tolerance,
        "{what}: {got:.0} IOPS, expected {want:.0} ± {:.0}%",
        tolerance * 100.0
    );
}

/// `iops=500` holds fio's 4 KiB random reads at QD32 to 500 IOPS and its
/// 64 KiB reads to 250 (each counts two 32 KiB units), while a volume
/// without a limit on the same cluster, read at the same time, is not
/// held back. The owner reports the time it held I/O back.
#[test]
fn an_iops_limit_holds_and_leaves_other_volumes_alone() {
    require("fio");
    let c = Cluster::start(4);
    c.create_volume("slow", "128M", "raid1 ftt=1 iops=500");
    c.create_volume("free", "128M", "raid1 ftt=1");
    // Something to read: the first 96 MiB of both.
    for v in ["slow", "free"] {
        c.shoal(&["volume", "set", v, "--iops", "0"]);
        sh(&format!(
            "fio --name=fill --ioengine=nbd --uri={} --rw=write --bs=1M --iodepth=8 --size=96M",
            c.uri(1, v)
        ));
    }
    c.shoal(&["volume", "set", "slow", "--iops", "500"]);

    let limited = fio_randread(&c.uri(1, "slow"), "4k", 8);
    let free = fio_randread(&c.uri(2, "free"), "4k", 8);
    let (limited, free) = (finish_fio(limited), finish_fio(free));
    eprintln!("4 KiB QD32: limited {limited:.0} IOPS, unlimited beside it {free:.0} IOPS");
    within("4 KiB reads at iops=500", limited, 500.0, 0.10);
    assert!(
        free > 3.0 * 500.0,
        "the volume without a limit was held back: {free:.0} IOPS"
    );
    let big = finish_fio(fio_randread(&c.uri(3, "slow"), "64k", 8));
    eprintln!("64 KiB QD32: limited {big:.0} IOPS");
    within("64 KiB reads at iops=500", big, 250.0, 0.10);

    let v = c.json(&["volume", "show", "slow"]);
    let t = &v["throttle"];
    assert_eq!(t["iops_limit"], 500, "{v}");
    assert!(t["throttled_ios"].as_u64().unwrap_or(0) > 1000, "{v}");
    assert!(t["throttled_us"].as_u64().unwrap_or(0) > 1_000_000, "{v}");
    let owner = v["volume"]["owner"].as_u64().expect("an owner") as u32;
    assert!(c.metric(&[owner], "shoal_volume_throttled_microseconds_total") > 1_000_000);
    let text = c.shoal(&["volume", "show", "slow"]);
    assert!(text.contains("iops limit  500"), "{text}");
    assert!(text.contains("throttled"), "{text}");
}

/// A new limit applies to a client that stays connected, and 0 lifts it.
#[test]
fn a_changed_limit_applies_without_reconnecting() {
    let c = Cluster::start(4);
    c.create_volume("v", "64M", "raid1 ftt=1 iops=300");
    let load = ReadLoad::start(&c.nbd_addr(1), "v", 32, 4096, 64 << 20);
    let window = Duration::from_secs(3);
    // The first window includes the burst allowance (30 I/Os at 300).
    let at300 = load.rate(window);
    c.shoal(&["volume", "set", "v", "--iops", "900"]);
    let at900 = load.rate(window);
    c.shoal(&["volume", "set", "v", "--iops", "0"]);
    let free = load.rate(window);
    eprintln!("one connection: {at300:.0} IOPS at 300, {at900:.0} at 900, {free:.0} without");
    assert_eq!(load.failed(), 0, "reads failed");
    load.stop();
    within("at iops=300", at300, 300.0, 0.15);
    within("at iops=900", at900, 900.0, 0.15);
    assert!(free > 1.5 * 900.0, "no limit: {free:.0} IOPS");
    let v = c.json(&["volume", "show", "v"]);
    assert_eq!(v["volume"]["policy"]["iops_limit"], 0, "{v}");
}
