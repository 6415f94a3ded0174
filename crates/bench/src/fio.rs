//! The fio engine: the same profile as a fio job file (kept next to the
//! results, so any figure can be reproduced with fio alone), run with
//! `--output-format=json+`, whose full latency histograms ("bins") are
//! loaded into HDR histograms and summarised like the native engine's.
//! Per-second series come from fio's iops/bw/lat logs.

use crate::hist::Lat;
use crate::native::{Outcome, Spec};
use crate::report::Sample;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where one fio job does its I/O.
#[derive(Debug, Clone)]
pub enum Where {
    /// fio's nbd engine (libnbd): `nbd://host:port/export`.
    Nbd { uri: String },
    /// io_uring with `direct=1` on a file.
    File { path: PathBuf },
}

#[derive(Debug, Clone)]
pub struct Job {
    pub name: String,
    pub at: Where,
    pub offset: u64,
    pub size: u64,
}

/// The `rw=` value and its companions for a profile.
fn rw_lines(spec: &Spec) -> Vec<String> {
    let random = spec.random_pct > 0;
    let mut v = Vec::new();
    let rw = match (spec.read_pct, random) {
        (100, true) => "randread",
        (100, false) => "read",
        (0, true) => "randwrite",
        (0, false) => "write",
        (_, true) => "randrw",
        (_, false) => "rw",
    };
    v.push(format!("rw={rw}"));
    if spec.read_pct > 0 && spec.read_pct < 100 {
        v.push(format!("rwmixread={}", spec.read_pct));
    }
    if random && spec.random_pct < 100 {
        v.push(format!("percentage_random={}", spec.random_pct));
    }
    v
}

/// A fio job file for `spec` on `jobs`; logs go to `log_prefix`_*.log.
pub fn job_file(title: &str, spec: &Spec, jobs: &[Job], log_prefix: &Path, zero_pct: u8) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# shoal bench: {title}");
    let _ = writeln!(
        s,
        "# reproduce with: fio --output-format=json+ --output=out.json THIS_FILE"
    );
    s.push_str("[global]\n");
    let direct = jobs.iter().any(|j| matches!(j.at, Where::File { .. }));
    if direct {
        s.push_str("ioengine=io_uring\ndirect=1\n");
    } else {
        s.push_str("ioengine=nbd\n");
    }
    let _ = writeln!(s, "bs={}", spec.block_size);
    for l in rw_lines(spec) {
        let _ = writeln!(s, "{l}");
    }
    let _ = writeln!(s, "iodepth={}", spec.outstanding);
    s.push_str("time_based=1\n");
    let _ = writeln!(s, "runtime={}ms", spec.duration.as_millis().max(1));
    if !spec.warmup.is_zero() {
        let _ = writeln!(s, "ramp_time={}ms", spec.warmup.as_millis());
    }
    // Threads, not a process per job: on a small machine fio's job
    // processes cost visibly more scheduling than one process
    // (bench/RESULTS.md, 2026-11-30, group commit and fio's engine).
    s.push_str("thread=1\ngroup_reporting=1\nrandrepeat=0\nnorandommap=1\n");
    s.push_str("percentile_list=50:95:99:99.9\n");
    if zero_pct > 0 {
        let _ = writeln!(s, "buffer_compress_percentage={}", zero_pct.min(99));
        s.push_str("refill_buffers=1\n");
    }
    if let Some(r) = spec.rate_limit {
        // fio caps each direction separately: split the total.
        let per_job = r as f64 / jobs.len().max(1) as f64;
        let part = |pct: u8| {
            if pct == 0 {
                String::new()
            } else {
                ((per_job * pct as f64 / 100.0).round() as u64)
                    .max(1)
                    .to_string()
            }
        };
        let _ = writeln!(
            s,
            "rate_iops={},{}",
            part(spec.read_pct),
            part(100 - spec.read_pct)
        );
        s.push_str("rate_process=linear\n");
    }
    let p = log_prefix.display();
    let _ = writeln!(
        s,
        "log_avg_msec=1000\nwrite_iops_log={p}\nwrite_bw_log={p}\nwrite_lat_log={p}"
    );
    for j in jobs {
        let _ = writeln!(s, "\n[{}]", j.name);
        match &j.at {
            Where::Nbd { uri } => {
                let _ = writeln!(s, "uri={uri}");
            }
            Where::File { path } => {
                let _ = writeln!(s, "filename={}", path.display());
            }
        }
        if j.offset > 0 {
            let _ = writeln!(s, "offset={}", j.offset);
        }
        let _ = writeln!(s, "size={}", j.size);
    }
    s
}

/// Runs fio on `job_path`, writing JSON to `json_path` and fio's messages
/// to `json_path` with `.log`.
pub async fn run(job_path: &Path, json_path: &Path, timeout: Duration) -> Result<String> {
    let log = json_path.with_extension("log");
    let logf = std::fs::File::create(&log)?;
    let mut cmd = tokio::process::Command::new("fio");
    cmd.arg("--output-format=json+")
        .arg(format!("--output={}", json_path.display()))
        .arg(job_path)
        .stdin(std::process::Stdio::null())
        .stdout(logf.try_clone()?)
        .stderr(logf)
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .context("starting fio (is it installed? Debian: apt-get install fio)")?;
    let st = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(st) => st?,
        Err(_) => {
            let _ = child.kill().await;
            bail!(
                "fio did not finish within {timeout:?}; see {}",
                log.display()
            );
        }
    };
    let text = std::fs::read_to_string(json_path).unwrap_or_default();
    if !st.success() || text.trim().is_empty() {
        let msg = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = msg.lines().rev().take(5).collect();
        bail!(
            "fio failed ({st}): {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
        );
    }
    Ok(text)
}

fn bins(dir: &Value) -> Lat {
    let mut h = Lat::new();
    if let Some(b) = dir["clat_ns"]["bins"].as_object() {
        for (k, v) in b {
            if let (Ok(ns), Some(n)) = (k.parse::<u64>(), v.as_u64()) {
                if n > 0 {
                    h.record_n(ns, n);
                }
            }
        }
    }
    h
}

/// What fio measured: latency histograms from the json+ bins (completion
/// latency), bytes and the measured seconds.
pub fn parse(text: &str) -> Result<(Outcome, f64)> {
    // fio may print messages ("fio: connected to NBD server") before the JSON.
    let start = text.find('{').context("no JSON in fio's output")?;
    let v: Value = serde_json::from_str(&text[start..]).context("parsing fio's JSON")?;
    let jobs = v["jobs"].as_array().context("fio JSON has no jobs")?;
    let mut out = Outcome::default();
    let mut secs: f64 = 0.0;
    for j in jobs {
        let err = j["error"].as_i64().unwrap_or(0);
        if err != 0 {
            out.errors += 1;
            out.first_error
                .get_or_insert(format!("fio job {} failed with error {err}", j["jobname"]));
        }
        for (d, lat, bytes) in [
            ("read", &mut out.read, &mut out.read_bytes),
            ("write", &mut out.write, &mut out.write_bytes),
        ] {
            let dir = &j[d];
            *bytes += dir["io_bytes"].as_u64().unwrap_or(0);
            lat.merge(&bins(dir));
            let rt = dir["runtime"].as_f64().unwrap_or(0.0) / 1000.0;
            secs = secs.max(rt);
        }
    }
    Ok((out, secs))
}

fn read_log(path: &Path) -> Vec<(u64, f64, u8)> {
    let Ok(t) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    t.lines()
        .filter_map(|l| {
            let mut f = l.split(',').map(str::trim);
            let ms = f.next()?.parse::<u64>().ok()?;
            let v = f.next()?.parse::<f64>().ok()?;
            let d = f.next()?.parse::<u8>().ok()?;
            Some((ms, v, d))
        })
        .collect()
}

/// Per-second series from fio's logs of `njobs` jobs (files
/// `<prefix>_iops.<i>.log`, `_bw`, `_lat`, i from 1), up to `secs`.
pub fn series(prefix: &Path, njobs: usize, secs: f64) -> Vec<Sample> {
    let name = |kind: &str, i: usize| PathBuf::from(format!("{}_{kind}.{i}.log", prefix.display()));
    // fio's last entry covers a partial second: keep whole seconds only.
    let last = ((secs + 0.5).floor() as u64).saturating_sub(1);
    let mut iops: BTreeMap<u64, f64> = BTreeMap::new();
    let mut bw: BTreeMap<u64, f64> = BTreeMap::new();
    let mut lat: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for i in 1..=njobs {
        for (ms, v, _) in read_log(&name("iops", i)) {
            let s = (ms + 500) / 1000;
            if (1..=last).contains(&s) {
                *iops.entry(s).or_default() += v;
            }
        }
        for (ms, v, _) in read_log(&name("bw", i)) {
            let s = (ms + 500) / 1000;
            if (1..=last).contains(&s) {
                *bw.entry(s).or_default() += v * 1024.0;
            }
        }
        for (ms, v, _) in read_log(&name("lat", i)) {
            let s = (ms + 500) / 1000;
            if (1..=last).contains(&s) {
                let e = lat.entry(s).or_default();
                e.0 += v;
                e.1 += 1.0;
            }
        }
    }
    iops.iter()
        .map(|(&s, &n)| {
            let l = lat.get(&s).map(|&(sum, c)| sum / c / 1000.0).unwrap_or(0.0);
            Sample {
                t: s as f64,
                iops: n,
                mbps: bw.get(&s).copied().unwrap_or(0.0) / 1e6,
                lat_avg_us: l,
                lat_max_us: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(read: u8, random: u8) -> Spec {
        Spec {
            block_size: 8192,
            read_pct: read,
            random_pct: random,
            outstanding: 4,
            warmup: Duration::from_secs(2),
            duration: Duration::from_secs(5),
            rate_limit: None,
            ios_per_target: None,
        }
    }

    #[test]
    fn job_files_carry_the_profile() {
        let jobs = vec![
            Job {
                name: "bench-w0-d0".into(),
                at: Where::Nbd {
                    uri: "nbd://127.0.0.1:10809/bench-w0-d0".into(),
                },
                offset: 0,
                size: 1 << 28,
            },
            Job {
                name: "bench-w1-d0".into(),
                at: Where::Nbd {
                    uri: "nbd://127.0.0.2:10809/bench-w1-d0".into(),
                },
                offset: 0,
                size: 1 << 28,
            },
        ];
        let mut s = spec(70, 100);
        s.rate_limit = Some(1000);
        let f = job_file("t", &s, &jobs, Path::new("/tmp/x"), 50);
        for want in [
            "ioengine=nbd",
            "bs=8192",
            "rw=randrw",
            "rwmixread=70",
            "iodepth=4",
            "runtime=5000ms",
            "ramp_time=2000ms",
            "thread=1",
            "rate_iops=350,150",
            "buffer_compress_percentage=50",
            "uri=nbd://127.0.0.2:10809/bench-w1-d0",
            "[bench-w0-d0]",
        ] {
            assert!(f.contains(want), "{want} missing in\n{f}");
        }
        assert!(!f.contains("percentage_random"));
        let f = job_file(
            "t",
            &spec(100, 0),
            &[Job {
                name: "raw".into(),
                at: Where::File {
                    path: "/tmp/f".into(),
                },
                offset: 4096,
                size: 8192,
            }],
            Path::new("/tmp/x"),
            0,
        );
        assert!(f.contains("ioengine=io_uring\ndirect=1\n"));
        assert!(f.contains("rw=read\n") && f.contains("offset=4096"));
        assert!(job_file("t", &spec(0, 50), &[], Path::new("/x"), 0)
            .contains("rw=randwrite\npercentage_random=50\n"));
    }

    #[test]
    fn series_from_logs_of_several_jobs() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("l");
        for i in 1..=2 {
            let f = |k: &str| format!("{}_{k}.{i}.log", p.display());
            std::fs::write(
                f("iops"),
                "1000, 100, 0, 0, 0\n1000, 50, 1, 0, 0\n2000, 200, 0, 0, 0\n3000, 7, 0, 0, 0\n",
            )
            .unwrap();
            std::fs::write(f("bw"), "1000, 1000, 0, 0, 0\n2000, 2000, 0, 0, 0\n").unwrap();
            std::fs::write(f("lat"), "1000, 100000, 0, 0, 0\n1000, 300000, 1, 0, 0\n").unwrap();
        }
        let s = series(&p, 2, 3.0);
        assert_eq!(s.len(), 2, "the partial last second is dropped: {s:?}");
        assert_eq!(s[0].t, 1.0);
        assert_eq!(s[0].iops, 300.0);
        assert_eq!(s[1].iops, 400.0);
        assert!((s[0].mbps - 2.048).abs() < 1e-9);
        assert!((s[0].lat_avg_us - 200.0).abs() < 1e-9);
        assert!(series(&p, 2, 0.2).is_empty());
    }

    #[test]
    fn parses_fio_json_plus() {
        let text = r#"fio: connected to NBD server
        {"jobs": [{"jobname": "a", "error": 0,
          "read": {"io_bytes": 4096000, "runtime": 5000,
                   "clat_ns": {"N": 1000, "bins": {"100000": 500, "200000": 499, "5000000": 1}}},
          "write": {"io_bytes": 0, "runtime": 0, "clat_ns": {"N": 0}}}]}"#;
        let (o, secs) = parse(text).unwrap();
        assert_eq!(secs, 5.0);
        assert_eq!(o.read_bytes, 4_096_000);
        assert_eq!(o.read.count(), 1000);
        assert_eq!(o.write.count(), 0);
        let s = o.read.summary();
        assert!((s.p50_us - 100.0).abs() < 0.5, "{s:?}");
        assert!((s.p99_us - 200.0).abs() < 0.5, "{s:?}");
        assert!((s.max_us - 5000.0).abs() < 5.0, "{s:?}");
        assert!(parse("no json").is_err());
    }
}
