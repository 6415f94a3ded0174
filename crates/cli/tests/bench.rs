//! `shoal bench` end to end: a short run against a local cluster, checked
//! through its JSON, CSV and HTML, and the bench volumes gone afterwards.

mod common;

use common::*;
use std::time::Instant;

#[test]
fn bench_quick_run_reports_sane_figures_and_cleans_up() {
    require("fio");
    let t = Instant::now();
    let c = Cluster::start(3);
    let out = c.data.parent().unwrap().join("bench-out");
    let stdout = c.shoal(&[
        "bench",
        "--quick",
        "--duration",
        "2",
        "--warmup",
        "1",
        "--size",
        "64M",
        "--profiles",
        "4k-randread,4k-randwrite",
        "--engine",
        "both",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(stdout.contains("4k-randread"), "{stdout}");
    assert!(stdout.contains("p99"), "{stdout}");

    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).expect("results.json"))
            .expect("valid JSON");
    assert_eq!(v["config"]["nodes"].as_array().unwrap().len(), 3);
    assert_eq!(v["config"]["policy"], "raid1 ftt=1");
    assert_eq!(v["config"]["copies"], 2);
    let profiles = v["profiles"].as_array().unwrap();
    assert_eq!(profiles.len(), 2);
    for p in profiles {
        let name = p["profile"]["name"].as_str().unwrap();
        let runs = p["runs"].as_array().unwrap();
        let engines: Vec<&str> = runs.iter().map(|r| r["engine"].as_str().unwrap()).collect();
        assert_eq!(engines, ["native", "fio-nbd"], "{name}");
        for r in runs {
            let f = |k: &str| r["lat"][k].as_f64().unwrap();
            let iops = r["iops"].as_f64().unwrap();
            assert!(iops > 0.0, "{name}: no IOPS: {r}");
            assert!(r["mbps"].as_f64().unwrap() > 0.0, "{name}");
            assert!(
                f("p50_us") > 0.0
                    && f("p50_us") <= f("p95_us")
                    && f("p95_us") <= f("p99_us")
                    && f("p99_us") <= f("p999_us")
                    && f("p999_us") <= f("max_us"),
                "{name}: percentiles out of order: {}",
                r["lat"]
            );
            assert_eq!(r["errors"], 0, "{name}");
            // 4 KiB per I/O. fio's byte count and its latency samples may
            // differ by an I/O at the edge of the measured window (seen:
            // 4097.04 bytes per I/O over ~3,900 I/Os), so allow 0.2%.
            let mbps = r["mbps"].as_f64().unwrap();
            assert!(
                (mbps * 1e6 / iops - 4096.0).abs() < 4096.0 * 0.002,
                "{name}: {mbps} MB/s at {iops} IOPS"
            );
            assert!(
                !r["series"].as_array().unwrap().is_empty(),
                "{name}: no series"
            );
            let cpu = &r["cpu"];
            assert!(
                cpu["seconds"].as_f64().unwrap() > 0.0,
                "{name}: no CPU: {cpu}"
            );
            assert_eq!(cpu["processes"].as_array().unwrap().len(), 3);
        }
        let native = &runs[0];
        if name == "4k-randwrite" {
            let b = &native["backend"];
            let client = b["client_write_bytes"].as_u64().unwrap();
            assert!(client > 0);
            // Measured from the nodes' device write counters: both copies
            // of every write, give or take what was in flight at the edges
            // of the window.
            assert!(b["source"].as_str().unwrap().starts_with("measured"), "{b}");
            let ratio = b["backend_write_bytes"].as_u64().unwrap() as f64 / client as f64;
            assert!(
                (1.8..=2.2).contains(&ratio),
                "backend/client = {ratio}: {b}"
            );
            // the nodes saw at least what the bench measured
            assert!(b["node_nbd_write_bytes"].as_u64().unwrap() >= client / 2);
            assert!(b["device_syncs"].as_u64().unwrap() > 0);
            assert_eq!(native["read_iops"].as_f64().unwrap(), 0.0);
        } else {
            assert_eq!(native["write_iops"].as_f64().unwrap(), 0.0);
        }
    }

    let csv = std::fs::read_to_string(out.join("results.csv")).expect("results.csv");
    assert_eq!(csv.lines().count(), 1 + 4, "{csv}");
    let html = std::fs::read_to_string(out.join("report.html")).expect("report.html");
    assert!(html.contains("<svg") && !html.contains("<script"));
    assert!(out.join("fio").read_dir().unwrap().count() >= 4);

    // The bench volumes are gone.
    let vols = c.json(&["volume", "list"]);
    let left: Vec<&str> = vols
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["volume"]["name"].as_str())
        .filter(|n| n.starts_with("bench-"))
        .collect();
    assert!(left.is_empty(), "bench volumes left behind: {left:?}");
    eprintln!("[bench] took {:.1?}", t.elapsed());
}

/// `shoal bench --policies` on a cluster started with two devices per
/// node: each policy's run in its folder, and one table of them with the
/// ratios to the first; its refusals of bad lists.
#[test]
fn bench_compares_policies_side_by_side() {
    let c = Cluster::start_with(3, &["--devices-per-node", "2"]);
    let st = c.json(&["status"]);
    assert_eq!(st["devices"].as_array().unwrap().len(), 6, "{st}");
    let out = c.data.parent().unwrap().join("bench-out");
    let stdout = c.shoal(&[
        "bench",
        "--quick",
        "--duration",
        "1",
        "--warmup",
        "1",
        "--size",
        "32M",
        "--volumes",
        "1",
        "--profiles",
        "4k-randwrite",
        "--policies",
        "raid1 ftt=1,raid5",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(stdout.contains("ratios to \"raid1 ftt=1\""), "{stdout}");
    let table = std::fs::read_to_string(out.join("policies.txt")).expect("policies.txt");
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("4k-randwrite"))
        .collect();
    assert_eq!(rows.len(), 2, "{table}");
    assert!(
        rows[0].contains("raid1 ftt=1") && rows[0].contains("1.00"),
        "{table}"
    );
    assert!(rows[1].contains("raid5"), "{table}");
    for (folder, policy) in [
        ("policy-raid1-ftt_1", "raid1 ftt=1"),
        ("policy-raid5", "raid5"),
    ] {
        let v: serde_json::Value = serde_json::from_slice(
            &std::fs::read(out.join(folder).join("results.json")).expect("results.json"),
        )
        .expect("valid JSON");
        assert_eq!(v["config"]["policy"], policy);
        let iops = v["profiles"][0]["runs"][0]["iops"].as_f64().unwrap_or(0.0);
        assert!(iops > 0.0, "{policy}: no IOPS");
    }
    for (list, want) in [
        ("raid1 ftt=1", "at least two policies"),
        ("raid1 ftt=1,raid7", "raid7"),
    ] {
        let e = c.shoal_fails(&["bench", "--quick", "--policies", list]);
        assert!(e.contains(want), "{list}: {e}");
    }
}
