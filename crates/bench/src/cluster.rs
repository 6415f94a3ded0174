//! What the bench asks of the cluster, through the REST API and `/metrics`
//! only: bench volumes (create, wait healthy, delete), health polling
//! during measured windows, metric scrapes, and CPU time of local node
//! processes from `/proc`.

use anyhow::{bail, Context, Result};
use shoal_api::{Client, CreateVolume, StatusReport};
use shoal_model::{ComponentState, NodeState, VolumeHealth};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
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
    let present: Vec<&String> = names.iter().filter(|n| existing.contains_key(*n)).collect();
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
                    .filter_map(|n| match s.volumes.iter().find(|v| &v.volume.name == n) {
                        Some(v) if v.health == VolumeHealth::Healthy => None,
                        Some(v) => Some(format!("{n} is {}", v.health)),
                        None => Some(format!("{n} is missing")),
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

/// Where the bench volumes' data copies landed: copies per node, and the
/// devices that cannot hold them once every copy is fully written
/// (`need` bytes per copy on top of what the device already uses).
pub fn placement(
    s: &StatusReport,
    names: &[String],
    need: u64,
) -> (BTreeMap<u64, usize>, Vec<String>) {
    let mut per_node: BTreeMap<u64, usize> = s.nodes.iter().map(|n| (n.id, 0)).collect();
    let mut per_dev: BTreeMap<u64, u64> = BTreeMap::new();
    for v in s.volumes.iter().filter(|v| names.contains(&v.volume.name)) {
        for c in v.volume.data_components() {
            *per_node.entry(c.node).or_default() += 1;
            *per_dev.entry(c.device).or_default() += need;
        }
    }
    let mut over = Vec::new();
    for d in &s.devices {
        let want = per_dev.get(&d.id).copied().unwrap_or(0);
        if want > 0 && d.used.max(d.reserved) + want > d.capacity {
            over.push(format!(
                "device {} of node {} would need {} for {} bench copies but has {} free",
                d.id,
                d.node,
                shoal_model::human_size(want),
                want / need.max(1),
                shoal_model::human_size(d.capacity.saturating_sub(d.used.max(d.reserved)))
            ));
        }
    }
    (per_node, over)
}

/// Something in a status report that means a measured window was not
/// quiet.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Issue {
    NodeDown(u64),
    /// A component of this volume was being resynced.
    Resyncing(String),
    /// A component of this volume was absent (its host unreachable).
    Absent(String),
    /// A component of this volume was degraded (rebuild needed).
    Degraded(String),
    /// The volume was inaccessible.
    Inaccessible(String),
}

/// Nodes down, components not active, volumes inaccessible.
pub fn issues(s: &StatusReport) -> Vec<Issue> {
    let mut v = Vec::new();
    for n in &s.nodes {
        if n.state != NodeState::Up {
            v.push(Issue::NodeDown(n.id));
        }
    }
    for vol in &s.volumes {
        let name = &vol.volume.name;
        if vol.health == VolumeHealth::Inaccessible {
            v.push(Issue::Inaccessible(name.clone()));
        }
        for c in &vol.volume.components {
            match c.state {
                // Being copied to, as a resync is.
                ComponentState::Resyncing | ComponentState::Reconfiguring => {
                    v.push(Issue::Resyncing(name.clone()))
                }
                ComponentState::Absent => v.push(Issue::Absent(name.clone())),
                ComponentState::Degraded => v.push(Issue::Degraded(name.clone())),
                ComponentState::Active => {}
            }
        }
    }
    v.sort();
    v.dedup();
    v
}

fn some_names(v: &[&String]) -> String {
    let mut s: Vec<&str> = v.iter().take(4).map(|x| x.as_str()).collect();
    if v.len() > 4 {
        s.push("...");
    }
    s.join(", ")
}

/// Issues seen during a window, in a few lines.
pub fn describe(seen: &BTreeSet<Issue>) -> Vec<String> {
    let mut out = Vec::new();
    let down: Vec<String> = seen
        .iter()
        .filter_map(|i| match i {
            Issue::NodeDown(n) => Some(n.to_string()),
            _ => None,
        })
        .collect();
    if !down.is_empty() {
        out.push(format!("node {} went down", down.join(", ")));
    }
    let of = |want: fn(&Issue) -> Option<&String>| -> Vec<&String> {
        seen.iter().filter_map(want).collect()
    };
    let groups: [(Vec<&String>, &str); 4] = [
        (
            of(|i| match i {
                Issue::Resyncing(v) => Some(v),
                _ => None,
            }),
            "a resync ran on {n} volume(s) ({names})",
        ),
        (
            of(|i| match i {
                Issue::Degraded(v) => Some(v),
                _ => None,
            }),
            "{n} volume(s) had a degraded component to rebuild ({names})",
        ),
        (
            of(|i| match i {
                Issue::Absent(v) => Some(v),
                _ => None,
            }),
            "{n} volume(s) had an absent component ({names})",
        ),
        (
            of(|i| match i {
                Issue::Inaccessible(v) => Some(v),
                _ => None,
            }),
            "{n} volume(s) were inaccessible ({names})",
        ),
    ];
    for (vols, text) in groups {
        if !vols.is_empty() {
            out.push(
                text.replace("{n}", &vols.len().to_string())
                    .replace("{names}", &some_names(&vols)),
            );
        }
    }
    out
}

/// Polls `GET /v1/status` every second until stopped; collects issues
/// other than those in `known` (seen before the run), except resyncs,
/// which always count.
pub struct Monitor {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Monitor {
    pub fn start(c: Client, known: Arc<BTreeSet<Issue>>) -> Monitor {
        let (stop, mut rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            let mut seen = BTreeSet::new();
            let mut failures = 0u32;
            loop {
                match tokio::time::timeout(Duration::from_secs(2), c.status()).await {
                    Ok(Ok(s)) => seen.extend(
                        issues(&s)
                            .into_iter()
                            .filter(|i| matches!(i, Issue::Resyncing(_)) || !known.contains(i)),
                    ),
                    _ => failures += 1,
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = rx.changed() => break,
                }
            }
            let mut v = describe(&seen);
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
/// `token`: the API token to present (`/metrics` needs a read-only one).
pub async fn scrape(apis: &[String], token: Option<&str>) -> (BTreeMap<String, f64>, Vec<String>) {
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
        let req = match token {
            Some(t) => http.get(&url).bearer_auth(t),
            None => http.get(&url),
        };
        async move {
            let r = req.send().await.ok()?;
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

    use shoal_api::VolumeReport;
    use shoal_model::{
        Component, ComponentRole, DeviceInfo, DeviceState, NodeInfo, Policy, Volume,
    };

    fn status(states: [ComponentState; 3]) -> StatusReport {
        let nodes = (1..=3)
            .map(|id| NodeInfo {
                id,
                fault_domain: format!("node-{id}"),
                peer_addr: String::new(),
                api_addr: String::new(),
                nbd_addr: String::new(),
                state: NodeState::Up,
            })
            .collect();
        let devices: Vec<DeviceInfo> = (1..=3)
            .map(|id| DeviceInfo {
                id,
                node: id,
                path: String::new(),
                capacity: 1 << 30,
                used: 0,
                reserved: 0,
                state: DeviceState::Healthy,
                provisioned: 0,
                maintenance: false,
                retiring: false,
                store_uuid: 0,
            })
            .collect();
        let comp = |i: usize, role| Component {
            id: 10 + i as u64,
            role,
            node: 1 + i as u64,
            device: 1 + i as u64,
            state: states[i],
            votes: 1,
        };
        let volume = Volume {
            id: 1,
            name: "bench-w0-d0".into(),
            size: 1 << 28,
            policy: Policy::default(),
            components: vec![
                comp(0, ComponentRole::Data),
                comp(1, ComponentRole::Data),
                comp(2, ComponentRole::Witness),
            ],
            owner: Some(1),
            generation: 3,
            problem: None,
            wrapped_key: None,
            reconfig: None,
            wanted_policy: None,
            grow_to: None,
            map_log_at: None,
            stripe: None,
        };
        let health = if states.iter().all(|s| *s == ComponentState::Active) {
            VolumeHealth::Healthy
        } else {
            VolumeHealth::ReducedAvailability
        };
        StatusReport {
            cluster_id: "c".into(),
            leader: Some(1),
            voters: vec![1, 2, 3],
            nodes,
            devices: devices
                .into_iter()
                .map(|device| shoal_api::DeviceReport {
                    device,
                    node_state: NodeState::Up,
                })
                .collect(),
            volumes: vec![VolumeReport {
                volume,
                health,
                uris: Vec::new(),
                throttle: None,
                resync: None,
                healing: String::new(),
                capacity: None,
            }],
            capacity: None,
        }
    }

    #[test]
    fn a_resync_is_an_issue_and_a_quiet_cluster_is_not() {
        use ComponentState::*;
        let vol = || "bench-w0-d0".to_string();
        assert!(issues(&status([Active, Active, Active])).is_empty());
        let v = issues(&status([Active, Resyncing, Active]));
        assert_eq!(v, vec![Issue::Resyncing(vol())]);
        let mut s = status([Active, Absent, Active]);
        s.nodes[1].state = NodeState::Down;
        s.volumes[0].health = VolumeHealth::Inaccessible;
        let mut seen: BTreeSet<Issue> = issues(&s).into_iter().collect();
        seen.extend(issues(&status([Active, Resyncing, Active])));
        let d = describe(&seen);
        assert_eq!(
            d,
            vec![
                "node 2 went down".to_string(),
                "a resync ran on 1 volume(s) (bench-w0-d0)".to_string(),
                "1 volume(s) had an absent component (bench-w0-d0)".to_string(),
                "1 volume(s) were inaccessible (bench-w0-d0)".to_string(),
            ]
        );
    }

    #[test]
    fn placement_counts_copies_and_finds_full_devices() {
        let s = status([ComponentState::Active; 3]);
        let names = vec!["bench-w0-d0".to_string()];
        let (per_node, over) = placement(&s, &names, 1 << 28);
        assert_eq!(
            per_node.into_iter().collect::<Vec<_>>(),
            vec![(1, 1), (2, 1), (3, 0)]
        );
        assert!(over.is_empty());
        let (_, over) = placement(&s, &names, 2 << 30);
        assert_eq!(over.len(), 2, "{over:?}");
        assert!(over[0].contains("node 1"));
    }

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
