//! What the bench asks of the cluster, through the REST API and `/metrics`
//! only: bench volumes (create, wait healthy, delete), health polling
//! during measured windows, metric scrapes, and CPU time of local node
//! processes from `/proc`.

use anyhow::{bail, Context, Result};
use shoal_api::{Client, CreateVolume, StatusReport};
use shoal_model::{ComponentState, NodeState, VolumeHealth};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Creates the bench volumes that are missing. Returns, per name, whether
/// it was created now (and so needs the fill).
pub async fn ensure_volumes(
    c: &Client,
    names: &[String],
    size: u64,
    policy: &str,
    reuse: bool,
) -> Result<Vec<bool>> {
    let existing: BTreeMap<String, u64> = c
        .volumes()
        .await
        .context("listing volumes")?
        .into_iter()
        .map(|v| (v.volume.name, v.volume.size))
        .collect();
    let present: Vec<&String> = names
        .iter()
        .filter(|n| existing.contains_key(*n))
        .collect();
    if !present.is_empty() && !reuse {
        bail!(
            "bench volumes already exist ({}{}), left by an earlier run? Pass --reuse to run on them, or delete them with `shoal volume delete NAME`",
            present
                .iter()
                .take(4)
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            if present.len() > 4 { ", ..." } else { "" }
        );
    }
    let mut created = Vec::new();
    for n in names {
        match existing.get(n) {
            Some(&have) => {
                if have < size {
                    bail!(
                        "volume {n} has {} but the bench needs {}: pass a smaller --size or delete it",
                        shoal_model::human_size(have),
                        shoal_model::human_size(size)
                    );
                }
                created.push(false);
            }
            None => {
                c.create_volume(&CreateVolume {
                    name: n.clone(),
                    size,
                    policy: policy.to_string(),
                })
                .await
                .with_context(|| format!("creating volume {n} ({policy})"))?;
                created.push(true);
            }
        }
    }
    Ok(created)
}

/// Waits until every named volume is healthy.
pub async fn wait_healthy(c: &Client, names: &[String], timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match c.status().await {
            Ok(s) => {
                let bad: Vec<String> = names
                    .iter()
                    .filter_map(|n| {
                        match s.volumes.iter().find(|v| &v.volume.name == n) {
                            Some(v) if v.health == VolumeHealth::Healthy => None,
                            Some(v) => Some(format!("{n} is {}", v.health)),
                            None => Some(format!("{n} is missing")),
                        }
                    })
                    .collect();
                if bad.is_empty() {
                    return Ok(());
                }
                bad.join(", ")
            }
            Err(e) => e.to_string(),
        };
        if Instant::now() > deadline {
            bail!("bench volumes not healthy after {timeout:?}: {last}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Deletes the named volumes (forcing: the bench's own connections may
/// still be closing). Returns the names that could not be deleted.
pub async fn delete_volumes(c: &Client, names: &[String]) -> Vec<(String, String)> {
    let mut failed = Vec::new();
    for n in names {
        let mut last = None;
        for attempt in 0..5 {
            match c.delete_volume(n, true).await {
                Ok(_) => {
                    last = None;
                    break;
                }
                Err(e) => {
                    let msg = e.to_string();
                    if msg.contains("no volume") {
                        last = None;
                        break;
                    }
                    last = Some(msg);
                    tokio::time::sleep(Duration::from_millis(300 * (attempt + 1))).await;
                }
            }
        }
        if let Some(e) = last {
            failed.push((n.clone(), e));
        }
    }
    failed
}

/// What in a status report means a measured window was not quiet: nodes
/// down, volumes not healthy, components not active.
pub fn issues(s: &StatusReport) -> Vec<String> {
    let mut v = Vec::new();
    for n in &s.nodes {
        if n.state != NodeState::Up {
            v.push(format!("node {} is {}", n.id, n.state));
        }
    }
    for vol in &s.volumes {
        if vol.health != VolumeHealth::Healthy {
            v.push(format!("volume {} was {}", vol.volume.name, vol.health));
        }
        for c in &vol.volume.components {
            if matches!(
                c.state,
                ComponentState::Resyncing | ComponentState::Absent | ComponentState::Degraded
            ) {
                v.push(format!(
                    "volume {} component {} on node {} was {:?}{}",
                    vol.volume.name,
                    c.id,
                    c.node,
                    c.state,
                    if c.state == ComponentState::Resyncing {
                        " (resync running)"
                    } else {
                        ""
                    }
                ));
            }
        }
    }
    v
}

/// Polls `GET /v1/status` every second until stopped; collects issues.
pub struct Monitor {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Monitor {
    pub fn start(c: Client) -> Monitor {
        let (stop, mut rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut seen = BTreeSet::new();
            let mut failures = 0u32;
            loop {
                match tokio::time::timeout(Duration::from_secs(2), c.status()).await {
                    Ok(Ok(s)) => seen.extend(issues(&s)),
                    _ => failures += 1,
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = rx.changed() => break,
                }
            }
            let mut v: Vec<String> = seen.into_iter().collect();
            if failures > 0 {
                v.push(format!(
                    "the cluster's status did not answer {failures} time(s) during the window"
                ));
            }
            v
        });
        Monitor { stop, task }
    }

    pub async fn finish(self) -> Vec<String> {
        let _ = self.stop.send(true);
        self.task.await.unwrap_or_default()
    }
}

/// Sums the samples of each metric over their labels, from Prometheus
/// text format.
pub fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    for l in text.lines() {
        let l = l.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let name_end = l.find(['{', ' ']).unwrap_or(l.len());
        let name = &l[..name_end];
        let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        *m.entry(name.to_string()).or_insert(0.0) += v;
    }
    m
}

/// `/metrics` of every node (`api` addresses), summed over nodes. A node
/// that does not answer is left out and named in the second value.
pub async fn scrape(apis: &[String]) -> (BTreeMap<String, f64>, Vec<String>) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap_or_default();
    let gets = apis.iter().map(|a| {
        let http = http.clone();
        let url = if a.starts_with("http") {
            format!("{a}/metrics")
        } else {
            format!("http://{a}/metrics")
        };
        async move {
            let r = http.get(&url).send().await.ok()?;
            if !r.status().is_success() {
                return None;
            }
            r.text().await.ok()
        }
    });
    let mut sum = BTreeMap::new();
    let mut missing = Vec::new();
    let texts = futures::future::join_all(gets).await;
    for (a, t) in apis.iter().zip(texts) {
        match t {
            Some(t) => {
                for (k, v) in parse_metrics(&t) {
                    *sum.entry(k).or_insert(0.0) += v;
                }
            }
            None => missing.push(a.clone()),
        }
    }
    (sum, missing)
}

/// Clock ticks per second of `/proc/PID/stat` times.
pub fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// User + system CPU seconds of a process so far.
pub fn cpu_seconds(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_from_stat(&stat).map(|t| t as f64 / clk_tck())
}

/// utime + stime (ticks) from the text of `/proc/PID/stat`.
pub fn cpu_from_stat(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: fields
    // after the last ')' start with field 3 (state).
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The running node processes of a local cluster: `<data>/node*/node.pid`.
pub fn node_pids(data: &Path) -> Vec<(String, i32)> {
    let mut v = Vec::new();
    let Ok(rd) = std::fs::read_dir(data) else {
        return v;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("node") {
            continue;
        }
        let Ok(t) = std::fs::read_to_string(e.path().join("node.pid")) else {
            continue;
        };
        let Ok(pid) = t.trim().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let zombie = stat
            .rfind(')')
            .map(|i| stat[i + 1..].trim_start().starts_with('Z'))
            .unwrap_or(true);
        if !zombie && String::from_utf8_lossy(&cmd).contains("node") {
            v.push((name, pid));
        }
    }
    v.sort_by_key(|(n, _)| (n.len(), n.clone()));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_summed_over_labels() {
        let m = parse_metrics(
            "# HELP shoal_nbd_writes_total x\n# TYPE shoal_nbd_writes_total counter\nshoal_nbd_writes_total{node=\"1\"} 12\nshoal_device_syncs_total{node=\"1\",device=\"1\"} 5\nshoal_device_syncs_total{node=\"1\",device=\"2\"} 7\nplain 1.5\n",
        );
        assert_eq!(m["shoal_nbd_writes_total"], 12.0);
        assert_eq!(m["shoal_device_syncs_total"], 12.0);
        assert_eq!(m["plain"], 1.5);
    }

    #[test]
    fn stat_fields() {
        let s = "1234 (shoal node (x)) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 9 0 100 1000 10";
        assert_eq!(cpu_from_stat(s), Some(300));
        assert_eq!(cpu_from_stat("garbage"), None);
        // our own process has a readable stat
        assert!(cpu_seconds(std::process::id() as i32).is_some());
    }
}
