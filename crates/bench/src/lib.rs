//! # shoal-bench: HCIbench for Shoal, with the ceilings beside every result
//!
//! `shoal bench` creates a set of volumes on a running cluster, fills them,
//! runs workload profiles (the Easy Run set and custom ones) from W workers
//! with D volumes each and T outstanding I/Os per volume, and reports IOPS,
//! throughput and latency percentiles from HDR histograms, per-second
//! series, CPU per I/O of the node processes, backend writes against client
//! writes, and, with `--baseline`, the same profiles on a raw file (fio,
//! io_uring, `direct=1`) and on nbdkit serving a file, with the ratios.
//! Output: a live progress line, a final table, and JSON, CSV and a
//! self-contained HTML report in `--out`.
//!
//! Owns load generation, measurement and reports. Must never touch cluster
//! internals: it talks to the cluster only through NBD (its own small
//! client, or fio's nbd engine), the REST API (`shoal_api::Client`) and the
//! nodes' `/metrics`, and reads `/proc` for the CPU time of local node
//! processes.

pub mod cluster;
pub mod compare;
pub mod fio;
pub mod hist;
pub mod native;
pub mod nbd;
pub mod profile;
pub mod report;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use hist::Lat;
use native::{Live, Outcome, Spec};
use profile::{parse_duration, Profile};
use report::{
    Backend, ClientCpu, Config, Cpu, LatencyTarget, NodeConf, ProfileResult, Ratio, Report, Run,
    Sample, Step,
};
use shoal_api::Client;
use shoal_model::{human_size, parse_size, NodeState, Policy};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Load engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    /// Shoal's own async NBD client.
    Native,
    /// fio's nbd engine (libnbd), from a job file kept with the results.
    Fio,
    /// Both, one after the other, to compare them.
    Both,
}

/// How volumes are prepared before the first profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fill {
    /// Random data (see --compressibility).
    Random,
    /// Zeros, written (not trimmed).
    Zero,
    /// Leave them empty (thin: reads of unwritten blocks are not real reads).
    None,
}

/// `shoal bench`: run workload profiles against the cluster.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// A run of seconds: 3 s warm-up and 5 s measured per profile, 1 worker
    /// per node with 2 volumes of 128 MiB.
    #[arg(long)]
    pub quick: bool,
    /// Profiles, comma-separated: names (4k-randread, 4k-randwrite,
    /// 4k-rand70, 8k-rand50, 512k-seqread, 512k-seqwrite, 8k-rand70,
    /// 1m-seqread, 1m-seqwrite, or from --profile-file) and the groups
    /// easy-run and all [default: easy-run, or the file's profiles].
    #[arg(long)]
    pub profiles: Option<String>,
    /// TOML file of custom profiles: [[profile]] tables with name,
    /// block_size, read_pct, random_pct, outstanding, duration, warmup,
    /// rate_limit.
    #[arg(long)]
    pub profile_file: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = EngineArg::Native)]
    pub engine: EngineArg,
    /// Also run every profile on a raw file (fio, io_uring, direct=1) and on
    /// nbdkit serving a file, and print the ratios.
    #[arg(long)]
    pub baseline: bool,
    /// Folder for the baseline's file (default: the output folder).
    #[arg(long)]
    pub baseline_dir: Option<PathBuf>,
    /// Workers per up node [default: 2; quick: 1].
    #[arg(long)]
    pub workers_per_node: Option<usize>,
    /// Workers in all (overrides --workers-per-node); worker w uses node w % nodes.
    #[arg(long)]
    pub workers: Option<usize>,
    /// Volumes per worker [default: 4; quick: 2].
    #[arg(long)]
    pub volumes: Option<usize>,
    /// Outstanding I/Os per volume, for every profile [default: the
    /// profile's, else 4 up to 64 KiB blocks and 2 above].
    #[arg(long)]
    pub outstanding: Option<u32>,
    /// Working set: size of each volume [default: 128M].
    #[arg(long)]
    pub size: Option<String>,
    /// Policy of the bench volumes [default: as `shoal up` picks for the
    /// cluster size: ftt=0, raid1 ftt=1 from 3 nodes, raid1 ftt=2 from 5].
    #[arg(long)]
    pub policy: Option<String>,
    /// Policies to compare, comma-separated (e.g. "raid1 ftt=1,raid5"):
    /// every profile runs on each, one after the other on the same
    /// cluster, and a table gives each one's IOPS, p99 latency and CPU per
    /// I/O with the ratio to the first. Each policy's results go to a
    /// folder of its own under the output folder.
    #[arg(long, conflicts_with = "policy")]
    pub policies: Option<String>,
    /// Preparation of new volumes.
    #[arg(long, value_enum, default_value_t = Fill::Random)]
    pub fill: Fill,
    /// Percent of every 4 KiB written that is zeros (fill and writes).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub compressibility: u8,
    /// Measured time per profile, e.g. 30, 30s, 2m [default: 30 s; quick: 5 s].
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Warm-up per profile, not counted [default: 10 s; quick: 3 s].
    #[arg(long, value_parser = parse_duration)]
    pub warmup: Option<Duration>,
    /// IOPS over all volumes, for every profile (latency is measured from
    /// the intended send time).
    #[arg(long)]
    pub rate_limit: Option<u64>,
    /// Latency-target mode: raise the outstanding I/Os (1, 2, 4, ...) until
    /// the latency percentile crosses this target (e.g. 1ms), and report
    /// the IOPS at the target.
    #[arg(long, value_parser = parse_duration)]
    pub latency_target: Option<Duration>,
    /// Percentile of latency-target mode [default: 95].
    #[arg(long)]
    pub latency_percentile: Option<f64>,
    /// Highest outstanding I/Os per volume latency-target mode tries
    /// [default: 64].
    #[arg(long)]
    pub max_outstanding: Option<u32>,
    /// Run on existing bench volumes (created if missing) and keep them.
    #[arg(long)]
    pub reuse: bool,
    /// Output folder [default: ./shoal-bench/<timestamp>].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Percentile of latency-target mode when none is given.
const LATENCY_PERCENTILE_DEFAULT: f64 = 95.0;
/// Highest outstanding I/Os per volume of latency-target mode by default.
const MAX_OUTSTANDING_DEFAULT: u32 = 64;

/// Refuses flags that would be accepted and then do nothing: a flag of a
/// mode that is not selected, or two flags that set the same thing.
fn check_flags(a: &BenchArgs) -> Result<()> {
    if a.latency_target.is_none() {
        if a.latency_percentile.is_some() {
            bail!("--latency-percentile applies only with --latency-target");
        }
        if a.max_outstanding.is_some() {
            bail!("--max-outstanding applies only with --latency-target");
        }
    }
    if let Some(p) = a.latency_percentile {
        if !(1.0..100.0).contains(&p) {
            bail!("--latency-percentile must be between 1 and 100");
        }
    }
    if a.max_outstanding == Some(0) {
        bail!("--max-outstanding must be at least 1");
    }
    if a.baseline_dir.is_some() && !a.baseline {
        bail!("--baseline-dir applies only with --baseline");
    }
    if a.workers.is_some() && a.workers_per_node.is_some() {
        bail!("give --workers or --workers-per-node, not both");
    }
    if a.latency_target.is_some() && a.rate_limit.is_some() {
        bail!(
            "--rate-limit and --latency-target cannot be combined: the target mode sets the load"
        );
    }
    Ok(())
}

/// Settings after defaults.
#[derive(Debug, Clone)]
struct Plan {
    profiles: Vec<Profile>,
    warmup: Duration,
    duration: Duration,
    workers_per_node: usize,
    volumes: usize,
    size: u64,
    engines: Vec<Engine>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Native,
    FioNbd,
    FioIoUring,
}

impl Engine {
    fn name(self) -> &'static str {
        match self {
            Engine::Native => "native",
            Engine::FioNbd => "fio-nbd",
            Engine::FioIoUring => "fio-io_uring",
        }
    }
}

const MIB: u64 = 1 << 20;

fn plan(a: &BenchArgs) -> Result<Plan> {
    let mut available = profile::builtins();
    let mut custom = Vec::new();
    if let Some(f) = &a.profile_file {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        custom = profile::parse_file(&text).with_context(|| format!("in {}", f.display()))?;
        available.retain(|p| !custom.iter().any(|c| c.name == p.name));
        available.extend(custom.iter().cloned());
    }
    let list = match (&a.profiles, custom.is_empty()) {
        (Some(l), _) => l.clone(),
        (None, true) => "easy-run".into(),
        (None, false) => custom
            .iter()
            .map(|p| p.name.clone())
            .collect::<Vec<_>>()
            .join(","),
    };
    let profiles = profile::select(&list, &available)?;
    if profiles.is_empty() {
        bail!("no profile selected");
    }
    let size = match &a.size {
        Some(s) => parse_size(s)?,
        None => 128 * MIB,
    };
    if size < MIB {
        bail!("--size must be at least 1M");
    }
    // Whole MiB: the fill writes 1 MiB at a time.
    let size = size.div_ceil(MIB) * MIB;
    let engines = match a.engine {
        EngineArg::Native => vec![Engine::Native],
        EngineArg::Fio => vec![Engine::FioNbd],
        EngineArg::Both => vec![Engine::Native, Engine::FioNbd],
    };
    check_flags(a)?;
    Ok(Plan {
        profiles,
        warmup: a
            .warmup
            .unwrap_or(Duration::from_secs(if a.quick { 3 } else { 10 })),
        duration: a
            .duration
            .unwrap_or(Duration::from_secs(if a.quick { 5 } else { 30 })),
        workers_per_node: a
            .workers_per_node
            .unwrap_or(if a.quick { 1 } else { 2 })
            .max(1),
        volumes: a.volumes.unwrap_or(if a.quick { 2 } else { 4 }).max(1),
        size,
        engines,
    })
}

/// The spec of a profile under the run's settings: command-line values
/// win over the profile's, which win over the run's defaults.
fn spec_for(p: &Profile, a: &BenchArgs, plan: &Plan) -> Spec {
    let default_qd = if p.block_size <= 64 * 1024 { 4 } else { 2 };
    Spec {
        block_size: p.block_size,
        read_pct: p.read_pct,
        random_pct: p.random_pct,
        outstanding: a.outstanding.or(p.outstanding).unwrap_or(default_qd),
        warmup: a.warmup.or(p.warmup).unwrap_or(plan.warmup),
        duration: a.duration.or(p.duration).unwrap_or(plan.duration),
        rate_limit: a.rate_limit.or(p.rate_limit),
        ios_per_target: None,
    }
}

/// The processes and endpoints behind one target of a run.
struct TargetSet {
    kind: &'static str,
    native: Vec<native::Target>,
    fio_jobs: Vec<fio::Job>,
    procs: Vec<(String, i32)>,
    apis: Vec<String>,
    /// The cluster to watch during measured windows, and the issues it
    /// already had before the run.
    monitor: Option<(Client, Arc<BTreeSet<cluster::Issue>>)>,
    copies: usize,
}

struct Ctx {
    out: PathBuf,
    pool: Arc<[u8]>,
    compressibility: u8,
    tty: bool,
}

/// Runs `shoal bench`. `data_dir` is the local cluster's folder (for the
/// node pids), `None` for a cluster given by address.
pub async fn run(args: BenchArgs, client: Client, data_dir: Option<PathBuf>) -> Result<()> {
    let Some(list) = args.policies.clone() else {
        return run_one(args, client, data_dir).await.map(|_| ());
    };
    let policies = compare::policies(&list)?;
    let out = match &args.out {
        Some(o) => o.clone(),
        None => PathBuf::from("shoal-bench").join(stamp(false)),
    };
    let mut reports = Vec::with_capacity(policies.len());
    for p in &policies {
        let mut one = args.clone();
        one.policies = None;
        one.policy = Some(p.clone());
        one.out = Some(out.join(compare::folder(p)));
        eprintln!("shoal bench: policy {p:?}");
        let r = run_one(one, client.clone(), data_dir.clone())
            .await
            .with_context(|| format!("policy {p:?}"))?;
        reports.push((p.clone(), r));
    }
    let table = compare::table(&reports);
    std::fs::write(out.join("policies.txt"), &table)?;
    std::fs::write(out.join("policies.csv"), compare::csv(&reports))?;
    println!("{table}");
    println!("wrote {0}/policies.txt, {0}/policies.csv", out.display());
    Ok(())
}

/// One bench run on one policy: its report, also written to its folder.
async fn run_one(
    args: BenchArgs,
    client: Client,
    data_dir: Option<PathBuf>,
) -> Result<report::Report> {
    let plan = plan(&args)?;
    let status = client
        .status()
        .await
        .context("asking the cluster for its status")?;
    let mut up: Vec<_> = status
        .nodes
        .iter()
        .filter(|n| n.state == NodeState::Up)
        .cloned()
        .collect();
    up.sort_by_key(|n| n.id);
    if up.is_empty() {
        bail!("no node of the cluster is up");
    }
    let policy_text = args.policy.clone().unwrap_or_else(|| {
        match status.nodes.len() {
            1 | 2 => "ftt=0",
            3 | 4 => "raid1 ftt=1",
            _ => "raid1 ftt=2",
        }
        .to_string()
    });
    let policy: Policy = policy_text
        .parse()
        .map_err(|e| anyhow!("--policy {policy_text:?}: {e}"))?;
    let workers = args
        .workers
        .unwrap_or(plan.workers_per_node * up.len())
        .max(1);
    let names: Vec<String> = (0..workers)
        .flat_map(|w| (0..plan.volumes).map(move |d| format!("bench-w{w}-d{d}")))
        .collect();

    let out = match &args.out {
        Some(o) => o.clone(),
        None => PathBuf::from("shoal-bench").join(stamp(false)),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    if args.engine != EngineArg::Native || args.baseline {
        require_tool("fio", "--version")?;
    }
    if args.baseline {
        require_tool("nbdkit", "--version")?;
    }

    eprintln!(
        "shoal bench: {} profiles, {} workers x {} volumes of {} ({}) on {} nodes, output in {}",
        plan.profiles.len(),
        workers,
        plan.volumes,
        human_size(plan.size),
        policy_text,
        up.len(),
        out.display()
    );
    let created =
        cluster::ensure_volumes(&client, &names, plan.size, &policy_text, args.reuse).await?;
    let body = body(
        &args,
        &plan,
        &client,
        &status,
        &up,
        &names,
        &created,
        &policy_text,
        &policy,
        workers,
        &out,
        data_dir,
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let result = tokio::select! {
        r = body => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
        _ = term.recv() => Err(anyhow!("terminated")),
    };
    if !args.reuse {
        let to_delete: Vec<String> = names
            .iter()
            .zip(&created)
            .filter(|(_, c)| **c)
            .map(|(n, _)| n.clone())
            .collect();
        let failed = cluster::delete_volumes(&client, &to_delete).await;
        if failed.is_empty() {
            eprintln!("deleted the {} bench volumes", to_delete.len());
        } else {
            for (n, e) in &failed {
                eprintln!("warning: could not delete volume {n}: {e}");
            }
        }
    }
    let report = result?;
    let json = serde_json::to_string_pretty(&report)?;
    std::fs::write(out.join("results.json"), json)?;
    std::fs::write(out.join("results.csv"), report::csv(&report))?;
    std::fs::write(out.join("report.html"), report::html(&report))?;
    println!("{}", report::table(&report));
    println!(
        "wrote {0}/results.json, {0}/results.csv, {0}/report.html",
        out.display()
    );
    Ok(report)
}

fn require_tool(tool: &str, arg: &str) -> Result<()> {
    match std::process::Command::new(tool)
        .arg(arg)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
    {
        Ok(_) => Ok(()),
        Err(_) => bail!("{tool} is needed and not installed (Debian: apt-get install {tool})"),
    }
}

#[allow(clippy::too_many_arguments)]
async fn body(
    args: &BenchArgs,
    plan: &Plan,
    client: &Client,
    status: &shoal_api::StatusReport,
    up: &[shoal_model::NodeInfo],
    names: &[String],
    created: &[bool],
    policy_text: &str,
    policy: &Policy,
    workers: usize,
    out: &Path,
    data_dir: Option<PathBuf>,
) -> Result<Report> {
    let started = stamp(true);
    cluster::wait_healthy(client, names, Duration::from_secs(120)).await?;
    let placed = client.status().await.context("reading the placement")?;
    let (placement, over) = cluster::placement(&placed, names, plan.size);
    if !over.is_empty() && args.fill != Fill::None {
        bail!(
            "the bench volumes do not fit where the cluster placed them: {}; bench data copies per node: {}. Pass a smaller --size or --volumes",
            over.join("; "),
            placement
                .iter()
                .map(|(n, c)| format!("node {n}: {c}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let shoal_targets: Vec<native::Target> = names
        .iter()
        .enumerate()
        .map(|(i, n)| native::Target {
            addr: up[(i / plan.volumes) % up.len()].nbd_addr.clone(),
            export: n.clone(),
            base: 0,
            size: plan.size,
        })
        .collect();
    // The volume as created (the policy with its defaults filled in).
    let vol_policy = client
        .volume(&names[0])
        .await
        .map(|v| v.volume.policy)
        .unwrap_or(*policy);

    // Preparation: once per volume set.
    let tty = stderr_is_tty();
    let zero_pct = match args.fill {
        Fill::Zero => 100,
        _ => args.compressibility,
    };
    let mut fill_seconds = 0.0;
    let to_fill: Vec<native::Target> = shoal_targets
        .iter()
        .zip(created)
        .filter(|(_, c)| **c)
        .map(|(t, _)| t.clone())
        .collect();
    if args.fill != Fill::None && !to_fill.is_empty() {
        let t = Instant::now();
        fill(&to_fill, plan.size, zero_pct, tty).await?;
        fill_seconds = t.elapsed().as_secs_f64();
    }

    let ctx = Ctx {
        out: out.to_path_buf(),
        pool: native::data_pool(
            (8 * MIB as usize).max(
                2 * plan
                    .profiles
                    .iter()
                    .map(|p| p.block_size)
                    .max()
                    .unwrap_or(0) as usize
                    + 4096,
            ),
            args.compressibility,
            42,
        ),
        compressibility: args.compressibility,
        tty,
    };

    let mut warnings = Vec::new();
    let mut notes = Vec::new();
    // Issues the cluster had before the bench began are reported once,
    // not in every window (resyncs excepted).
    let known: BTreeSet<cluster::Issue> = cluster::issues(status).into_iter().collect();
    for w in cluster::describe(&known) {
        warnings.push(format!("before the run: {w}"));
    }
    let (procs, cpu_note) = match &data_dir {
        None => (
            Vec::new(),
            "unavailable: the cluster was given by --api, its node processes are not local"
                .to_string(),
        ),
        Some(d) => {
            let p = cluster::node_pids(d);
            if p.is_empty() {
                (
                    Vec::new(),
                    format!("unavailable: no running node.pid under {}", d.display()),
                )
            } else {
                (
                    p.clone(),
                    format!(
                        "/proc/PID/stat of {} node processes ({})",
                        p.len(),
                        p.iter()
                            .map(|(n, pid)| format!("{n}={pid}"))
                            .collect::<Vec<_>>()
                            .join(" ")
                    ),
                )
            }
        }
    };
    if procs.is_empty() {
        warnings.push(format!("CPU per I/O {cpu_note}"));
    }
    let shoal = TargetSet {
        kind: "shoal",
        fio_jobs: shoal_targets
            .iter()
            .map(|t| fio::Job {
                name: t.export.clone(),
                at: fio::Where::Nbd {
                    uri: format!("nbd://{}/{}", t.addr, t.export),
                },
                offset: 0,
                size: t.size,
            })
            .collect(),
        native: shoal_targets.clone(),
        procs: procs.clone(),
        apis: up.iter().map(|n| n.api_addr.clone()).collect(),
        monitor: Some((client.clone(), Arc::new(known.clone()))),
        copies: vol_policy.copies(),
    };

    // Baselines: one file for both, each stream on its own region.
    let mut base = None;
    if args.baseline && args.latency_target.is_none() {
        let dir = args
            .baseline_dir
            .clone()
            .unwrap_or_else(|| out.to_path_buf());
        std::fs::create_dir_all(&dir)?;
        let b = Baseline::start(&dir, names.len(), plan.size, zero_pct).await?;
        base = Some(b);
    } else if args.baseline {
        notes.push("baselines are not run in latency-target mode".into());
    }

    let mut results = Vec::new();
    for p in &plan.profiles {
        let spec = spec_for(p, args, plan);
        if let Some(lt) = args.latency_target {
            results.push(latency_mode(&ctx, &shoal, plan.engines[0], p, &spec, lt, args).await?);
            continue;
        }
        let mut runs = Vec::new();
        for &e in &plan.engines {
            runs.push(measure(&ctx, &shoal, e, p, &spec).await?.0);
        }
        if let Some(b) = &base {
            runs.push(measure(&ctx, &b.raw, Engine::FioIoUring, p, &spec).await?.0);
            let e = if plan.engines[0] == Engine::Native {
                Engine::Native
            } else {
                Engine::FioNbd
            };
            runs.push(measure(&ctx, &b.nbdkit, e, p, &spec).await?.0);
        }
        let ratios = ratios(&runs);
        results.push(ProfileResult {
            profile: p.clone(),
            runs,
            ratios,
            latency_target: None,
        });
    }

    if results.iter().any(|r| {
        r.runs
            .iter()
            .filter_map(|x| x.backend.as_ref())
            .any(|b| b.source.starts_with("computed") && b.client_write_bytes > 0)
    }) {
        notes.push("backend writes are computed as client writes x the policy's copies: the nodes export no device write counter (only shoal_device_syncs_total and shoal_device_used_bytes)".into());
    }
    if base.is_some() {
        notes.push("shoal acknowledges a write once every copy is durable (fdatasync); the raw file uses O_DIRECT without syncs and nbdkit's file plugin the page cache without syncs".into());
    }
    if plan.engines.contains(&Engine::FioNbd) || base.is_some() {
        notes.push(format!(
            "fio figures are completion latencies (clat) from fio's json+ histograms; fio job files and JSON are in {}/fio",
            out.display()
        ));
    }

    let cap: u64 = status.devices.iter().map(|d| d.capacity).sum();
    let config = Config {
        shoal_version: format!(
            "{} (the bench's; nodes do not report theirs)",
            env!("CARGO_PKG_VERSION")
        ),
        started,
        cluster_id: status.cluster_id.clone(),
        nodes: status
            .nodes
            .iter()
            .map(|n| NodeConf {
                id: n.id,
                nbd_addr: n.nbd_addr.clone(),
                api_addr: n.api_addr.clone(),
                state: n.state.to_string(),
            })
            .collect(),
        devices: status.devices.len(),
        device_capacity_bytes: cap,
        policy: policy_text.to_string(),
        copies: vol_policy.copies(),
        witnesses: vol_policy.witnesses(),
        checksums: vol_policy.checksum,
        reserve_pct: vol_policy.reserve_pct,
        store: format!(
            "not exported by the API; {} device(s): {}",
            status.devices.len(),
            status
                .devices
                .iter()
                .map(|d| format!("node {} {} ({})", d.node, d.path, human_size(d.capacity)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        engine: match args.engine {
            EngineArg::Native => "native",
            EngineArg::Fio => "fio",
            EngineArg::Both => "native and fio",
        }
        .into(),
        workers,
        volumes_per_worker: plan.volumes,
        volume_size_bytes: plan.size,
        fill: format!("{:?}", args.fill).to_lowercase(),
        compressibility_pct: args.compressibility,
        warmup_s: args.warmup.unwrap_or(plan.warmup).as_secs_f64(),
        duration_s: args.duration.unwrap_or(plan.duration).as_secs_f64(),
        quick: args.quick,
        baseline: base.is_some(),
        baseline_file: base.as_ref().map(|b| b.file.display().to_string()),
        reused_volumes: created.iter().any(|c| !c),
        fill_seconds,
        cpu: cpu_note,
        placement: placement.into_iter().collect(),
    };
    drop(base);
    Ok(Report {
        config,
        profiles: results,
        warnings,
        notes,
    })
}

fn ratios(runs: &[Run]) -> Vec<Ratio> {
    let Some(primary) = runs.first() else {
        return Vec::new();
    };
    let div = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    runs.iter()
        .filter(|r| r.target != primary.target)
        .map(|r| Ratio {
            baseline: r.target.clone(),
            iops: div(primary.iops, r.iops),
            mbps: div(primary.mbps, r.mbps),
            p99_latency: div(primary.lat.p99_us, r.lat.p99_us),
        })
        .collect()
}

async fn latency_mode(
    ctx: &Ctx,
    ts: &TargetSet,
    engine: Engine,
    p: &Profile,
    spec: &Spec,
    target: Duration,
    args: &BenchArgs,
) -> Result<ProfileResult> {
    let target_us = target.as_secs_f64() * 1e6;
    let percentile = args
        .latency_percentile
        .unwrap_or(LATENCY_PERCENTILE_DEFAULT);
    let max_outstanding = args.max_outstanding.unwrap_or(MAX_OUTSTANDING_DEFAULT);
    let q = percentile / 100.0;
    let mut steps = Vec::new();
    let mut best: Option<(Run, f64)> = None;
    let mut first: Option<Run> = None;
    let mut crossed: Option<Step> = None;
    let mut qd = 1u32;
    loop {
        let mut s = spec.clone();
        s.outstanding = qd;
        let (run, lat) = measure(ctx, ts, engine, p, &s).await?;
        let l = lat.0.value_at_quantile(q) as f64 / 1000.0;
        let step = Step {
            outstanding: qd,
            iops: run.iops,
            latency_us: l,
        };
        steps.push(step.clone());
        if first.is_none() {
            first = Some(run.clone());
        }
        if l > target_us {
            crossed = Some(step);
            break;
        }
        best = Some((run, l));
        if qd >= max_outstanding {
            break;
        }
        qd = (qd * 2).min(max_outstanding);
    }
    let interpolated = match (&best, &crossed) {
        (Some((b, lb)), Some(c)) if c.latency_us > *lb => {
            Some(b.iops + (target_us - lb) / (c.latency_us - lb) * (c.iops - b.iops))
        }
        _ => None,
    };
    let lt = LatencyTarget {
        target_us,
        percentile,
        steps,
        outstanding_at_target: best.as_ref().map(|(r, _)| r.outstanding),
        iops_at_target: best.as_ref().map(|(r, _)| r.iops),
        iops_interpolated: interpolated,
    };
    let run = best.map(|(r, _)| r).or(first).expect("at least one step");
    Ok(ProfileResult {
        profile: p.clone(),
        runs: vec![run],
        ratios: Vec::new(),
        latency_target: Some(lt),
    })
}

/// Writes every volume once, sequentially, 1 MiB at a time.
async fn fill(targets: &[native::Target], size: u64, zero_pct: u8, tty: bool) -> Result<()> {
    let total = size * targets.len() as u64;
    eprintln!(
        "preparing {} volumes: writing {} ({})",
        targets.len(),
        human_size(total),
        if zero_pct >= 100 {
            "zeros".to_string()
        } else {
            format!("random data, {zero_pct}% zeros")
        }
    );
    let live = Arc::new(Live::default());
    let conns = native::connect_all(targets).await?;
    let spec = Spec {
        block_size: MIB,
        read_pct: 0,
        random_pct: 0,
        outstanding: 4,
        warmup: Duration::ZERO,
        duration: Duration::from_secs(24 * 3600),
        rate_limit: None,
        ios_per_target: Some(size / MIB),
    };
    let pool = native::data_pool(4 * MIB as usize, zero_pct, 7);
    let t = Instant::now();
    let l2 = live.clone();
    let progress = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if tty {
                let b = l2.bytes.load(Relaxed);
                eprint!(
                    "\r\x1b[K  {} of {} ({:.0} MB/s)",
                    human_size(b / MIB * MIB),
                    human_size(total),
                    b as f64 / t.elapsed().as_secs_f64() / 1e6
                );
            }
        }
    });
    let r = native::run(conns, &spec, pool, t, live.clone()).await;
    progress.abort();
    if tty {
        eprint!("\r\x1b[K");
    }
    let o = r.context("filling the bench volumes")?;
    if o.errors > 0 {
        bail!(
            "filling the bench volumes: {} writes failed: {}",
            o.errors,
            o.first_error.unwrap_or_default()
        );
    }
    eprintln!(
        "prepared in {:.1} s ({:.0} MB/s)",
        t.elapsed().as_secs_f64(),
        total as f64 / t.elapsed().as_secs_f64() / 1e6
    );
    Ok(())
}

/// Observations of one measured window, beside the engine.
#[derive(Default)]
struct Observed {
    series: Vec<Sample>,
    cpu: Option<(Vec<(String, f64)>, f64)>,
    metrics: Option<(BTreeMap<String, f64>, BTreeMap<String, f64>)>,
    missing_metrics: Vec<String>,
    events: Vec<String>,
}

fn cpu_now(procs: &[(String, i32)]) -> (Vec<(String, Option<f64>)>, Option<f64>) {
    (
        procs
            .iter()
            .map(|(n, pid)| (n.clone(), cluster::cpu_seconds(*pid)))
            .collect(),
        cluster::cpu_seconds(std::process::id() as i32),
    )
}

#[allow(clippy::too_many_arguments)]
async fn observe(
    label: String,
    t0: Instant,
    ms: Instant,
    me: Instant,
    live: Option<Arc<Live>>,
    procs: Vec<(String, i32)>,
    apis: Vec<String>,
    monitor: Option<(Client, Arc<BTreeSet<cluster::Issue>>)>,
    tty: bool,
) -> Observed {
    let mut o = Observed::default();
    let token = monitor
        .as_ref()
        .and_then(|(c, _)| c.token().map(String::from));
    let warm = (ms - t0).as_secs_f64().ceil() as i64;
    let meas = (me - ms).as_secs_f64().ceil() as i64;
    let snap = |l: &Option<Arc<Live>>| {
        l.as_ref()
            .map(|l| {
                (
                    l.ios.load(Relaxed),
                    l.bytes.load(Relaxed),
                    l.lat_sum_ns.load(Relaxed),
                )
            })
            .unwrap_or_default()
    };
    let mut prev = (0, 0, 0);
    let mut prev_t = ms;
    let mut cpu_before = None;
    let mut mon = None;
    let mut metrics_before = None;
    for k in -warm..=meas {
        let at = if k < 0 {
            match ms.checked_sub(Duration::from_secs((-k) as u64)) {
                Some(a) if a >= t0 => a,
                _ => continue,
            }
        } else {
            (ms + Duration::from_secs(k as u64)).min(me)
        };
        tokio::time::sleep_until(at).await;
        let s = snap(&live);
        let max_ns = live
            .as_ref()
            .map(|l| l.lat_max_ns.swap(0, Relaxed))
            .unwrap_or(0);
        if k == 0 {
            cpu_before = Some(cpu_now(&procs));
            if !apis.is_empty() {
                let (m, missing) = cluster::scrape(&apis, token.as_deref()).await;
                metrics_before = Some(m);
                o.missing_metrics.extend(missing);
            }
            mon = monitor
                .clone()
                .map(|(c, known)| cluster::Monitor::start(c, known));
            prev = s;
            prev_t = at;
        } else if k > 0 {
            let dt = (at - prev_t).as_secs_f64();
            if dt > 0.0 && live.is_some() {
                let ios = (s.0 - prev.0) as f64;
                o.series.push(Sample {
                    t: (at - ms).as_secs_f64(),
                    iops: ios / dt,
                    mbps: (s.1 - prev.1) as f64 / dt / 1e6,
                    lat_avg_us: if ios > 0.0 {
                        (s.2 - prev.2) as f64 / ios / 1000.0
                    } else {
                        0.0
                    },
                    lat_max_us: Some(max_ns as f64 / 1000.0),
                });
            }
            prev = s;
            prev_t = at;
        }
        if tty {
            let phase = if k < 0 {
                format!("warm-up {}/{} s", warm + k, warm)
            } else {
                format!("measuring {k}/{meas} s")
            };
            let figures = match o.series.last() {
                Some(x) if k > 0 => format!(
                    "  {} IOPS  {:.1} MB/s  avg {} ms",
                    x.iops.round(),
                    x.mbps,
                    report::ms(x.lat_avg_us)
                ),
                _ => String::new(),
            };
            eprint!("\r\x1b[K[{label}] {phase}{figures}");
            let _ = std::io::stderr().flush();
        }
    }
    if tty {
        eprint!("\r\x1b[K");
    }
    if let Some((before, bself)) = cpu_before {
        let (after, aself) = cpu_now(&procs);
        let per: Vec<(String, f64)> = before
            .into_iter()
            .zip(after)
            .filter_map(|((n, b), (_, a))| Some((n, a? - b?)))
            .collect();
        let me_cpu = match (bself, aself) {
            (Some(b), Some(a)) => a - b,
            _ => 0.0,
        };
        o.cpu = Some((per, me_cpu));
    }
    if let Some(m) = mon {
        o.events = m.finish().await;
    }
    if let Some(before) = metrics_before {
        let (after, missing) = cluster::scrape(&apis, token.as_deref()).await;
        o.missing_metrics.extend(missing);
        o.metrics = Some((before, after));
    }
    o
}

fn safe_name(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// One measured run of `spec` on a target set with an engine.
async fn measure(
    ctx: &Ctx,
    ts: &TargetSet,
    engine: Engine,
    p: &Profile,
    spec: &Spec,
) -> Result<(Run, Lat)> {
    let label = format!("{} {} ({})", p.name, ts.kind, engine.name());
    let live = Arc::new(Live::default());
    let conns = if engine == Engine::Native {
        Some(native::connect_all(&ts.native).await?)
    } else {
        None
    };
    let t0 = Instant::now();
    let ms = t0 + spec.warmup;
    let me = ms + spec.duration;
    let observer = tokio::spawn(observe(
        label.clone(),
        t0,
        ms,
        me,
        (engine == Engine::Native).then(|| live.clone()),
        ts.procs.clone(),
        ts.apis.clone(),
        ts.monitor.clone(),
        ctx.tty,
    ));
    let abort = observer.abort_handle();
    type EngineOut = (Outcome, f64, Option<Vec<Sample>>, Option<f64>);
    let engine_result: Result<EngineOut> = async {
        match engine {
            Engine::Native => {
                let o = native::run(
                    conns.expect("connected above"),
                    spec,
                    ctx.pool.clone(),
                    t0,
                    live.clone(),
                )
                .await?;
                Ok((o, spec.duration.as_secs_f64(), None, None))
            }
            Engine::FioNbd | Engine::FioIoUring => {
                let dir = ctx.out.join("fio");
                std::fs::create_dir_all(&dir)?;
                let base = dir.join(format!(
                    "{}__{}__{}__qd{}",
                    safe_name(&p.name),
                    ts.kind,
                    engine.name(),
                    spec.outstanding
                ));
                let logs = dir.join(format!("logs-{}", std::process::id()));
                std::fs::create_dir_all(&logs)?;
                let log_prefix = logs.join("l");
                let job = fio::job_file(
                    &format!("{} on {}", p.describe(), ts.kind),
                    spec,
                    &ts.fio_jobs,
                    &log_prefix,
                    ctx.compressibility,
                );
                let job_path = base.with_extension("fio");
                std::fs::write(&job_path, job)?;
                let json_path = base.with_extension("json");
                let timeout = spec.warmup
                    + spec.duration
                    + Duration::from_secs(60 + ts.fio_jobs.len() as u64);
                let cpu0 = children_cpu();
                let text = fio::run(&job_path, &json_path, timeout).await?;
                let cpu = children_cpu() - cpu0;
                let (o, secs) = fio::parse(&text)?;
                let series = fio::series(&log_prefix, ts.fio_jobs.len(), secs);
                let _ = std::fs::remove_dir_all(&logs);
                Ok((o, secs, Some(series), Some(cpu)))
            }
        }
    }
    .await;
    let (o, secs, series, fio_cpu) = match engine_result {
        Ok(x) => x,
        Err(e) => {
            abort.abort();
            if ctx.tty {
                eprint!("\r\x1b[K");
            }
            return Err(e.context(format!("running {label}")));
        }
    };
    let obs = observer.await.unwrap_or_default();
    let secs = if secs > 0.0 {
        secs
    } else {
        spec.duration.as_secs_f64()
    };
    let mut all = o.read.clone();
    all.merge(&o.write);
    let ios = all.count() as f64;
    let mut run = Run {
        target: ts.kind.into(),
        engine: engine.name().into(),
        outstanding: spec.outstanding,
        streams: if engine == Engine::Native {
            ts.native.len()
        } else {
            ts.fio_jobs.len()
        },
        seconds: secs,
        iops: ios / secs,
        read_iops: o.read.count() as f64 / secs,
        write_iops: o.write.count() as f64 / secs,
        mbps: (o.read_bytes + o.write_bytes) as f64 / secs / 1e6,
        lat: all.summary(),
        read_lat: o.read.summary(),
        write_lat: o.write.summary(),
        errors: o.errors,
        distribution: all.distribution(),
        series: series.unwrap_or(obs.series),
        ..Default::default()
    };
    if let Some((per, bench)) = obs.cpu {
        if !ts.procs.is_empty() && ios > 0.0 {
            let total: f64 = per.iter().map(|(_, s)| s).sum();
            run.cpu = Some(Cpu {
                processes: per,
                seconds: total,
                seconds_per_kio: total / (ios / 1000.0),
            });
        }
        if engine == Engine::Native && ios > 0.0 {
            run.client_cpu = Some(ClientCpu {
                seconds: bench,
                seconds_per_kio: bench / (ios / 1000.0),
            });
        }
    }
    if let (Some(c), true) = (fio_cpu, ios > 0.0) {
        // fio ran warm-up and measured window: count the window's share.
        let share = spec.duration.as_secs_f64() / (spec.duration + spec.warmup).as_secs_f64();
        run.client_cpu = Some(ClientCpu {
            seconds: c * share,
            seconds_per_kio: c * share / (ios / 1000.0),
        });
    }
    if let Some((before, after)) = &obs.metrics {
        let d = |k: &str| {
            (after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0)).max(0.0)
                as u64
        };
        let client = o.write_bytes;
        let (backend, source) = if after.contains_key("shoal_device_write_bytes_total") {
            (
                d("shoal_device_write_bytes_total"),
                "measured: shoal_device_write_bytes_total".to_string(),
            )
        } else {
            (
                client * ts.copies as u64,
                format!("computed: {} copies of the policy", ts.copies),
            )
        };
        let writes = o.write.count() as f64;
        let syncs = d("shoal_device_syncs_total");
        run.backend = Some(Backend {
            client_write_bytes: client,
            node_nbd_write_bytes: d("shoal_nbd_write_bytes_total"),
            backend_write_bytes: backend,
            amplification: if client > 0 {
                backend as f64 / client as f64
            } else {
                0.0
            },
            source,
            device_syncs: syncs,
            syncs_per_kwrite: if writes > 0.0 {
                syncs as f64 / (writes / 1000.0)
            } else {
                0.0
            },
            forwarded: d("shoal_forwarded_total"),
        });
    }
    for e in &obs.events {
        run.warnings
            .push(format!("during the measured window: {e}"));
    }
    if !obs.missing_metrics.is_empty() {
        let mut m = obs.missing_metrics.clone();
        m.sort();
        m.dedup();
        run.warnings
            .push(format!("no /metrics from {}", m.join(", ")));
    }
    if o.errors > 0 {
        run.warnings.push(format!(
            "{} I/O errors: {}",
            o.errors,
            o.first_error.clone().unwrap_or_default()
        ));
    }
    if ios == 0.0 {
        run.warnings
            .push("no I/O completed in the measured window".into());
    }
    eprintln!(
        "{:<40} {:>10} IOPS {:>8.1} MB/s  avg {} p99 {} max {} ms{}",
        label,
        run.iops.round(),
        run.mbps,
        report::ms(run.lat.mean_us),
        report::ms(run.lat.p99_us),
        report::ms(run.lat.max_us),
        if run.warnings.is_empty() {
            String::new()
        } else {
            format!("  ({} warnings)", run.warnings.len())
        }
    );
    Ok((run, all))
}

/// The baselines: a file written once, served raw (fio io_uring direct=1)
/// and by nbdkit's file plugin.
struct Baseline {
    file: PathBuf,
    raw: TargetSet,
    nbdkit: TargetSet,
    _child: tokio::process::Child,
}

impl Drop for Baseline {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.file);
    }
}

impl Baseline {
    async fn start(dir: &Path, streams: usize, size: u64, zero_pct: u8) -> Result<Baseline> {
        let file = dir.join("shoal-bench-baseline.raw");
        let total = size * streams as u64;
        eprintln!(
            "baseline: writing {} to {}",
            human_size(total),
            file.display()
        );
        let f2 = file.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            use std::io::Write;
            let mut f =
                std::fs::File::create(&f2).with_context(|| format!("creating {}", f2.display()))?;
            let pool = native::data_pool(4 * MIB as usize, zero_pct, 9);
            let mut r = native::Rng::new(3);
            for _ in 0..total / MIB {
                let off = (r.below(3 * MIB / 4096) * 4096) as usize;
                f.write_all(&pool[off..off + MIB as usize])?;
            }
            f.sync_all()?;
            Ok(())
        })
        .await
        .context("baseline file writer panicked")??;
        // A free port for nbdkit.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = tokio::process::Command::new("nbdkit")
            .args([
                "--foreground",
                "--exit-with-parent",
                "--ipaddr",
                "127.0.0.1",
                "--port",
            ])
            .arg(port.to_string())
            .arg("file")
            .arg(&file)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("starting nbdkit")?;
        let pid = child.id().unwrap_or(0) as i32;
        let addr = format!("127.0.0.1:{port}");
        let native: Vec<native::Target> = (0..streams)
            .map(|i| native::Target {
                addr: addr.clone(),
                export: String::new(),
                base: i as u64 * size,
                size,
            })
            .collect();
        // Wait until it serves.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match nbd::connect(&addr, "").await {
                Ok(_) => break,
                Err(e) if Instant::now() > deadline => {
                    return Err(e.context("nbdkit did not start serving"))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let nbdkit = TargetSet {
            kind: "nbdkit-file",
            fio_jobs: native
                .iter()
                .enumerate()
                .map(|(i, t)| fio::Job {
                    name: format!("nbdkit-{i}"),
                    at: fio::Where::Nbd {
                        uri: format!("nbd://{addr}/"),
                    },
                    offset: t.base,
                    size,
                })
                .collect(),
            native,
            procs: vec![("nbdkit".into(), pid)],
            apis: Vec::new(),
            monitor: None,
            copies: 1,
        };
        let raw = TargetSet {
            kind: "raw-file",
            native: Vec::new(),
            fio_jobs: (0..streams)
                .map(|i| fio::Job {
                    name: format!("raw-{i}"),
                    at: fio::Where::File { path: file.clone() },
                    offset: i as u64 * size,
                    size,
                })
                .collect(),
            procs: Vec::new(),
            apis: Vec::new(),
            monitor: None,
            copies: 1,
        };
        Ok(Baseline {
            file,
            raw,
            nbdkit,
            _child: child,
        })
    }
}

/// CPU seconds of every child process waited for so far (fio and the job
/// processes it waited for).
fn children_cpu() -> f64 {
    // SAFETY: all-zero bytes are a valid rusage (integers and timevals).
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes into the struct we own.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn stderr_is_tty() -> bool {
    // SAFETY: isatty only inspects the descriptor.
    unsafe { libc::isatty(2) == 1 }
}

/// UTC time: `2026-11-30T09:52:00Z`, or `20261130-095200` for a folder.
fn stamp(iso: bool) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (y, mo, d) = civil(secs / 86400);
    let s = secs % 86400;
    let (h, mi, se) = (s / 3600, s % 3600 / 60, s % 60);
    if iso {
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{se:02}Z")
    } else {
        format!("{y:04}{mo:02}{d:02}-{h:02}{mi:02}{se:02}")
    }
}

/// Days since 1970-01-01 to (year, month, day) (Howard Hinnant's algorithm).
fn civil(days: u64) -> (i64, u32, u32) {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: BenchArgs,
    }

    fn args(v: &[&str]) -> BenchArgs {
        let mut all = vec!["t"];
        all.extend_from_slice(v);
        T::try_parse_from(all).unwrap().a
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(19_723), (2024, 1, 1));
        assert_eq!(civil(19_782), (2024, 2, 29));
    }

    #[test]
    fn quick_and_full_defaults() {
        let q = plan(&args(&["--quick"])).unwrap();
        assert_eq!(q.profiles.len(), 6);
        assert_eq!((q.warmup.as_secs(), q.duration.as_secs()), (3, 5));
        assert_eq!((q.workers_per_node, q.volumes, q.size), (1, 2, 128 * MIB));
        let f = plan(&args(&[])).unwrap();
        assert_eq!((f.warmup.as_secs(), f.duration.as_secs()), (10, 30));
        assert_eq!((f.workers_per_node, f.volumes, f.size), (2, 4, 128 * MIB));
        let o = plan(&args(&[
            "--quick",
            "--duration",
            "2",
            "--warmup",
            "500ms",
            "--profiles",
            "4k-randread,1m-seqwrite",
            "--size",
            "1500K",
            "--engine",
            "both",
        ]))
        .unwrap();
        assert_eq!(o.profiles.len(), 2);
        assert_eq!(o.warmup, Duration::from_millis(500));
        assert_eq!(o.size, 2 * MIB, "rounded up to whole MiB");
        assert_eq!(o.engines, vec![Engine::Native, Engine::FioNbd]);
        assert!(plan(&args(&["--profiles", "nope"])).is_err());
    }

    #[test]
    fn command_line_wins_over_profile_over_defaults() {
        let mut p = profile::easy_run().remove(0);
        p.outstanding = Some(16);
        p.duration = Some(Duration::from_secs(7));
        let a = args(&["--quick"]);
        let pl = plan(&a).unwrap();
        let s = spec_for(&p, &a, &pl);
        assert_eq!(
            (s.outstanding, s.duration.as_secs(), s.warmup.as_secs()),
            (16, 7, 3)
        );
        let a = args(&["--quick", "--outstanding", "2", "--duration", "1"]);
        let s = spec_for(&p, &a, &pl);
        assert_eq!((s.outstanding, s.duration.as_secs()), (2, 1));
        let big = profile::builtins().pop().unwrap();
        assert_eq!(spec_for(&big, &args(&[]), &pl).outstanding, 2);
    }

    #[test]
    fn ratios_against_the_first_run() {
        let r = |t: &str, iops: f64| Run {
            target: t.into(),
            iops,
            ..Default::default()
        };
        let v = ratios(&[r("shoal", 100.0), r("shoal", 90.0), r("raw-file", 400.0)]);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].baseline, "raw-file");
        assert_eq!(v[0].iops, 0.25);
    }
}
