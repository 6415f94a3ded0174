//! Results and their forms: the final table, JSON, CSV and a self-contained
//! HTML report (inline CSS and SVG, no scripts, nothing fetched).

use crate::hist::LatSummary;
use crate::profile::Profile;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// One second of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the measured window opened (end of this second).
    pub t: f64,
    pub iops: f64,
    /// 10^6 bytes per second.
    pub mbps: f64,
    pub lat_avg_us: f64,
    pub lat_max_us: Option<f64>,
}

/// CPU time of the processes behind a target during a measured window.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Cpu {
    /// `name` (e.g. `node1`, `nbdkit`) and CPU seconds.
    pub processes: Vec<(String, f64)>,
    pub seconds: f64,
    pub seconds_per_kio: f64,
}

/// CPU time of the load generator: the bench process (native engine) or
/// fio and its job processes (scaled to the measured window).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClientCpu {
    pub seconds: f64,
    pub seconds_per_kio: f64,
}

/// Backend writes against client writes during a measured window.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Backend {
    /// Bytes the bench wrote and had acknowledged.
    pub client_write_bytes: u64,
    /// `shoal_nbd_write_bytes_total` of every node over the window.
    pub node_nbd_write_bytes: u64,
    /// Bytes written to devices: measured if the nodes export a counter,
    /// else client bytes times the policy's copies (`source` says which).
    pub backend_write_bytes: u64,
    pub amplification: f64,
    pub source: String,
    /// `shoal_device_syncs_total` over the window, every node.
    pub device_syncs: u64,
    pub syncs_per_kwrite: f64,
    /// `shoal_forwarded_total`: requests sent on to the owner's node.
    pub forwarded: u64,
}

/// One measured run of a profile on one target.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Run {
    /// `shoal`, `raw-file` or `nbdkit-file`.
    pub target: String,
    /// `native`, `fio-nbd` or `fio-io_uring`.
    pub engine: String,
    /// Outstanding I/Os per volume (stream).
    pub outstanding: u32,
    /// Volumes (streams) driven at once.
    pub streams: usize,
    pub seconds: f64,
    pub iops: f64,
    pub read_iops: f64,
    pub write_iops: f64,
    pub mbps: f64,
    pub lat: LatSummary,
    pub read_lat: LatSummary,
    pub write_lat: LatSummary,
    pub errors: u64,
    /// (quantile, µs) points of the latency distribution.
    pub distribution: Vec<(f64, f64)>,
    pub series: Vec<Sample>,
    pub cpu: Option<Cpu>,
    pub client_cpu: Option<ClientCpu>,
    pub backend: Option<Backend>,
    pub warnings: Vec<String>,
}

impl Run {
    pub fn label(&self) -> String {
        format!("{} ({})", self.target, self.engine)
    }
}

/// Shoal's figure divided by a baseline's.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ratio {
    pub baseline: String,
    pub iops: f64,
    pub mbps: f64,
    /// Shoal's p99 latency over the baseline's (lower is better).
    pub p99_latency: f64,
}

/// One step of latency-target mode.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Step {
    pub outstanding: u32,
    pub iops: f64,
    pub latency_us: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatencyTarget {
    pub target_us: f64,
    pub percentile: f64,
    pub steps: Vec<Step>,
    /// The best step within the target, if any.
    pub outstanding_at_target: Option<u32>,
    pub iops_at_target: Option<f64>,
    /// IOPS where the latency line crosses the target, interpolated
    /// between the last step within and the first above it.
    pub iops_interpolated: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProfileResult {
    pub profile: Profile,
    pub runs: Vec<Run>,
    pub ratios: Vec<Ratio>,
    pub latency_target: Option<LatencyTarget>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NodeConf {
    pub id: u64,
    pub nbd_addr: String,
    pub api_addr: String,
    pub state: String,
}

/// What was measured, on what.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Config {
    pub shoal_version: String,
    pub started: String,
    pub cluster_id: String,
    pub nodes: Vec<NodeConf>,
    pub devices: usize,
    pub device_capacity_bytes: u64,
    pub policy: String,
    pub copies: usize,
    pub witnesses: usize,
    pub checksums: bool,
    pub reserve_pct: u8,
    /// Store settings as far as the API shows them.
    pub store: String,
    pub engine: String,
    pub workers: usize,
    pub volumes_per_worker: usize,
    pub volume_size_bytes: u64,
    pub fill: String,
    pub compressibility_pct: u8,
    pub warmup_s: f64,
    pub duration_s: f64,
    pub quick: bool,
    pub baseline: bool,
    pub baseline_file: Option<String>,
    pub reused_volumes: bool,
    pub fill_seconds: f64,
    pub cpu: String,
    /// (node, data copies of bench volumes on it).
    pub placement: Vec<(u64, usize)>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub config: Config,
    pub profiles: Vec<ProfileResult>,
    pub warnings: Vec<String>,
    pub notes: Vec<String>,
}

fn group(n: f64) -> String {
    let i = n.round() as u64;
    let s = i.to_string();
    let mut out = String::new();
    for (k, c) in s.chars().enumerate() {
        if k > 0 && (s.len() - k).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Milliseconds with a precision that suits the value.
pub fn ms(us: f64) -> String {
    let m = us / 1000.0;
    if m < 1.0 {
        format!("{m:.3}")
    } else if m < 100.0 {
        format!("{m:.2}")
    } else {
        format!("{m:.0}")
    }
}

fn mbps(x: f64) -> String {
    if x < 10.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.1}")
    }
}

fn ratio_text(r: &Ratio) -> String {
    format!(
        "shoal {:.2}x",
        if r.iops.is_finite() { r.iops } else { 0.0 }
    )
}

/// The final table, as printed.
pub fn table(r: &Report) -> String {
    let c = &r.config;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Shoal bench: {} nodes, policy \"{}\" ({} copies, checksums {}), {} workers x {} volumes of {}, {} engine, {} s measured after {} s warm-up{}",
        c.nodes.len(),
        c.policy,
        c.copies,
        if c.checksums { "on" } else { "off" },
        c.workers,
        c.volumes_per_worker,
        shoal_model::human_size(c.volume_size_bytes),
        c.engine,
        c.duration_s,
        c.warmup_s,
        if c.quick { " (quick)" } else { "" }
    );
    if !c.placement.is_empty() {
        let _ = writeln!(
            s,
            "bench data copies per node: {}",
            c.placement
                .iter()
                .map(|(n, k)| format!("node {n}: {k}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(
        s,
        "latencies in ms; QD = outstanding I/Os per volume x volumes; CPU = CPU seconds of the target's processes per 1000 I/Os"
    );
    let head = [
        "profile", "target", "engine", "QD", "IOPS", "MB/s", "avg", "p50", "p95", "p99", "p99.9",
        "max", "CPU/kIO", "ratio",
    ];
    let mut rows: Vec<Vec<String>> = vec![head.iter().map(|h| h.to_string()).collect()];
    for p in &r.profiles {
        for (i, run) in p.runs.iter().enumerate() {
            let ratio = p
                .ratios
                .iter()
                .find(|x| x.baseline == run.target && run.target != "shoal")
                .map(ratio_text)
                .unwrap_or_default();
            rows.push(vec![
                if i == 0 {
                    p.profile.name.clone()
                } else {
                    String::new()
                },
                run.target.clone(),
                run.engine.clone(),
                format!("{}x{}", run.outstanding, run.streams),
                group(run.iops),
                mbps(run.mbps),
                ms(run.lat.mean_us),
                ms(run.lat.p50_us),
                ms(run.lat.p95_us),
                ms(run.lat.p99_us),
                ms(run.lat.p999_us),
                ms(run.lat.max_us),
                run.cpu
                    .as_ref()
                    .map(|c| format!("{:.3}", c.seconds_per_kio))
                    .unwrap_or_else(|| "-".into()),
                ratio,
            ]);
        }
    }
    let widths: Vec<usize> = (0..head.len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    for row in &rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            let w = widths[i];
            if i <= 2 || i == head.len() - 1 {
                let _ = write!(line, "{cell:<w$}  ");
            } else {
                let _ = write!(line, "{cell:>w$}  ");
            }
        }
        let _ = writeln!(s, "{}", line.trim_end());
    }
    // Engines side by side, when both ran.
    for p in &r.profiles {
        let nat = p
            .runs
            .iter()
            .find(|x| x.target == "shoal" && x.engine == "native");
        let fio = p
            .runs
            .iter()
            .find(|x| x.target == "shoal" && x.engine == "fio-nbd");
        if let (Some(a), Some(b)) = (nat, fio) {
            let client = |r: &Run| {
                r.client_cpu
                    .as_ref()
                    .map(|c| format!("{:.3}", c.seconds_per_kio))
                    .unwrap_or_else(|| "-".into())
            };
            let _ = writeln!(
                s,
                "native vs fio on {}: IOPS {:+.1}%, p50 {:+.1}%, p99 {:+.1}% (load generator CPU s/kIO: native {}, fio {})",
                p.profile.name,
                pct_diff(a.iops, b.iops),
                pct_diff(a.lat.p50_us, b.lat.p50_us),
                pct_diff(a.lat.p99_us, b.lat.p99_us),
                client(a),
                client(b)
            );
        }
    }
    let backend: Vec<_> = r
        .profiles
        .iter()
        .filter_map(|p| {
            p.runs
                .iter()
                .find(|x| x.target == "shoal")
                .and_then(|x| x.backend.as_ref().map(|b| (p, b)))
        })
        .filter(|(_, b)| b.client_write_bytes > 0)
        .collect();
    if !backend.is_empty() {
        let _ = writeln!(s, "\nwrites: client vs backend (shoal)");
        for (p, b) in backend {
            let _ = writeln!(
                s,
                "  {:<16} client {:>9.1} MB  backend {:>9.1} MB  x{:.2} ({})  fdatasyncs/1000 writes {:.1}  forwarded {}",
                p.profile.name,
                b.client_write_bytes as f64 / 1e6,
                b.backend_write_bytes as f64 / 1e6,
                b.amplification,
                b.source,
                b.syncs_per_kwrite,
                b.forwarded
            );
        }
    }
    for p in &r.profiles {
        if let Some(lt) = &p.latency_target {
            let _ = writeln!(
                s,
                "\nlatency target {} p{}: {}",
                p.profile.name,
                lt.percentile,
                match (lt.iops_at_target, lt.outstanding_at_target) {
                    (Some(i), Some(q)) => format!(
                        "{} IOPS at QD {q} within {} ms{}",
                        group(i),
                        ms(lt.target_us),
                        lt.iops_interpolated
                            .map(|x| format!(" (~{} IOPS where it crosses)", group(x)))
                            .unwrap_or_default()
                    ),
                    _ => format!("even QD 1 is above {} ms", ms(lt.target_us)),
                }
            );
            for st in &lt.steps {
                let _ = writeln!(
                    s,
                    "  QD {:>3}: {:>10} IOPS  p{} {} ms",
                    st.outstanding,
                    group(st.iops),
                    lt.percentile,
                    ms(st.latency_us)
                );
            }
        }
    }
    let mut warns: Vec<String> = r.warnings.clone();
    for p in &r.profiles {
        for run in &p.runs {
            for w in &run.warnings {
                warns.push(format!("{} on {}: {w}", p.profile.name, run.label()));
            }
        }
    }
    if !warns.is_empty() {
        let _ = writeln!(s);
        for w in warns {
            let _ = writeln!(s, "WARNING: {w}");
        }
    }
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

/// (a - b) / b in percent.
pub fn pct_diff(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        0.0
    } else {
        (a - b) / b * 100.0
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// One row per profile and run.
pub fn csv(r: &Report) -> String {
    let mut s = String::from(
        "profile,block_size,read_pct,random_pct,target,engine,outstanding,streams,seconds,iops,read_iops,write_iops,mb_per_s,lat_avg_us,lat_p50_us,lat_p95_us,lat_p99_us,lat_p999_us,lat_max_us,errors,cpu_s_per_kio,backend_write_amplification,iops_ratio,warnings\n",
    );
    for p in &r.profiles {
        for run in &p.runs {
            let ratio = p
                .ratios
                .iter()
                .find(|x| x.baseline == run.target)
                .map(|x| format!("{:.4}", x.iops))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "{},{},{},{},{},{},{},{},{:.3},{:.1},{:.1},{:.1},{:.3},{:.1},{:.1},{:.1},{:.1},{:.1},{:.1},{},{},{},{},{}",
                csv_field(&p.profile.name),
                p.profile.block_size,
                p.profile.read_pct,
                p.profile.random_pct,
                run.target,
                run.engine,
                run.outstanding,
                run.streams,
                run.seconds,
                run.iops,
                run.read_iops,
                run.write_iops,
                run.mbps,
                run.lat.mean_us,
                run.lat.p50_us,
                run.lat.p95_us,
                run.lat.p99_us,
                run.lat.p999_us,
                run.lat.max_us,
                run.errors,
                run.cpu
                    .as_ref()
                    .map(|c| format!("{:.4}", c.seconds_per_kio))
                    .unwrap_or_default(),
                run.backend
                    .as_ref()
                    .map(|b| format!("{:.2}", b.amplification))
                    .unwrap_or_default(),
                ratio,
                csv_field(&run.warnings.join("; "))
            );
        }
    }
    s
}

// ---------------------------------------------------------------------------
// HTML and SVG
// ---------------------------------------------------------------------------

/// Escapes text for HTML and SVG.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
];

/// A line of a chart.
pub struct Line {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

#[derive(Clone, Copy, PartialEq)]
pub enum Scale {
    Linear,
    Log,
}

/// A line chart as an inline SVG element.
pub fn chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    lines: &[Line],
    y_scale: Scale,
    x_ticks: Option<&[(f64, &str)]>,
) -> String {
    const W: f64 = 560.0;
    const H: f64 = 300.0;
    const L: f64 = 64.0;
    const R: f64 = 16.0;
    const T: f64 = 28.0;
    const B: f64 = 44.0;
    let pts: Vec<(f64, f64)> = lines
        .iter()
        .flat_map(|l| l.points.iter().copied())
        .filter(|p| p.0.is_finite() && p.1.is_finite())
        .collect();
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg class="chart" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img"><title>{}</title>"#,
        esc(title)
    );
    let _ = write!(
        s,
        r##"<rect x="0" y="0" width="{W}" height="{H}" fill="#fff"/><text x="{}" y="18" text-anchor="middle" font-size="13" font-weight="bold">{}</text>"##,
        W / 2.0,
        esc(title)
    );
    if pts.is_empty() {
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="12">no data</text></svg>"#,
            W / 2.0,
            H / 2.0
        );
        return s;
    }
    let (mut x0, mut x1) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    match x_ticks {
        Some(t) => {
            for (x, _) in t {
                x0 = x0.min(*x);
                x1 = x1.max(*x);
            }
        }
        // Linear axes start at 0.
        None => x0 = x0.min(0.0),
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let ymax = pts.iter().map(|p| p.1).fold(0.0, f64::max);
    let ymin_pos = pts
        .iter()
        .map(|p| p.1)
        .filter(|&y| y > 0.0)
        .fold(f64::MAX, f64::min);
    let (ya, yb, y_ticks): (f64, f64, Vec<f64>) = match y_scale {
        Scale::Log if ymin_pos < f64::MAX => {
            let a = ymin_pos.log10().floor();
            let mut b = ymax.log10().ceil();
            if b <= a {
                b = a + 1.0;
            }
            let ticks = (a as i32..=b as i32).map(|e| 10f64.powi(e)).collect();
            (a, b, ticks)
        }
        _ => {
            let (top, ticks) = linear_ticks(ymax);
            (0.0, top, ticks)
        }
    };
    let log = y_scale == Scale::Log && ymin_pos < f64::MAX;
    let px = |x: f64| L + (x - x0) / (x1 - x0) * (W - L - R);
    let py = |y: f64| {
        let v = if log { y.max(1e-12).log10() } else { y };
        H - B - (v - ya) / (yb - ya) * (H - T - B)
    };
    // axes and grid
    let _ = write!(
        s,
        r##"<g font-size="10" fill="#333" stroke-width="1"><line x1="{L}" y1="{}" x2="{}" y2="{}" stroke="#333"/><line x1="{L}" y1="{T}" x2="{L}" y2="{}" stroke="#333"/>"##,
        H - B,
        W - R,
        H - B,
        H - B
    );
    for y in &y_ticks {
        let yy = py(*y);
        let _ = write!(
            s,
            r##"<line x1="{L}" y1="{yy:.1}" x2="{}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - R,
            L - 4.0,
            yy + 3.0,
            tick_label(*y)
        );
    }
    let xt: Vec<(f64, String)> = match x_ticks {
        Some(t) => t.iter().map(|(x, l)| (*x, l.to_string())).collect(),
        None => linear_ticks(x1)
            .1
            .into_iter()
            .filter(|x| *x <= x1 + 1e-9)
            .map(|x| (x, tick_label(x)))
            .collect(),
    };
    for (x, l) in &xt {
        let xx = px(*x);
        let _ = write!(
            s,
            r##"<line x1="{xx:.1}" y1="{T}" x2="{xx:.1}" y2="{}" stroke="#eee"/><text x="{xx:.1}" y="{}" text-anchor="middle">{}</text>"##,
            H - B,
            H - B + 14.0,
            esc(l)
        );
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="11">{}</text><text x="14" y="{}" text-anchor="middle" font-size="11" transform="rotate(-90 14 {})">{}</text></g>"#,
        (L + W - R) / 2.0,
        H - 8.0,
        esc(x_label),
        (T + H - B) / 2.0,
        (T + H - B) / 2.0,
        esc(y_label)
    );
    for (i, l) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let d: Vec<String> = l
            .points
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite() && (!log || p.1 > 0.0))
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        if !d.is_empty() {
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{}"/>"#,
                d.join(" ")
            );
        }
        let ly = T + 4.0 + 14.0 * i as f64;
        let _ = write!(
            s,
            r#"<rect x="{}" y="{:.1}" width="10" height="3" fill="{color}"/><text x="{}" y="{:.1}" font-size="10">{}</text>"#,
            L + 8.0,
            ly + 4.0,
            L + 22.0,
            ly + 8.0,
            esc(&l.name)
        );
    }
    s.push_str("</svg>");
    s
}

/// A round step giving about five intervals up to `max`, and the ticks
/// from 0 to the first multiple of the step at or above `max`.
fn linear_ticks(max: f64) -> (f64, Vec<f64>) {
    let step = nice_ceiling(max.max(1e-9) / 5.0);
    let n = (max.max(1e-9) / step - 1e-9).ceil().max(1.0) as usize;
    let ticks: Vec<f64> = (0..=n).map(|i| step * i as f64).collect();
    (step * n as f64, ticks)
}

fn nice_ceiling(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let e = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * e >= v {
            return m * e;
        }
    }
    10.0 * e
}

fn tick_label(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1e6 {
        format!("{}M", trim(v / 1e6))
    } else if v.abs() >= 1e4 {
        format!("{}k", trim(v / 1e3))
    } else {
        trim(v)
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// x position of a quantile on the "nines" axis.
fn nines(q: f64) -> f64 {
    if q >= 1.0 {
        5.5
    } else {
        (-(1.0 - q).log10()).min(5.0)
    }
}

const NINES_TICKS: &[(f64, &str)] = &[
    (0.301, "50%"),
    (1.0, "90%"),
    (2.0, "99%"),
    (3.0, "99.9%"),
    (4.0, "99.99%"),
    (5.0, "99.999%"),
    (5.5, "max"),
];

/// The latency distribution chart of a profile's runs.
pub fn latency_chart(p: &ProfileResult) -> String {
    let lines: Vec<Line> = p
        .runs
        .iter()
        .map(|r| Line {
            name: r.label(),
            points: r
                .distribution
                .iter()
                .filter(|&&(q, _)| q >= 0.1)
                .map(|&(q, us)| (nines(q), us / 1000.0))
                .collect(),
        })
        .collect();
    chart(
        &format!("{}: latency distribution", p.profile.name),
        "percentile",
        "latency (ms, log)",
        &lines,
        Scale::Log,
        Some(NINES_TICKS),
    )
}

/// IOPS per second of a profile's runs.
pub fn iops_chart(p: &ProfileResult) -> String {
    let lines: Vec<Line> = p
        .runs
        .iter()
        .map(|r| Line {
            name: r.label(),
            points: r.series.iter().map(|s| (s.t, s.iops)).collect(),
        })
        .collect();
    chart(
        &format!("{}: IOPS over time", p.profile.name),
        "seconds into the measured window",
        "IOPS",
        &lines,
        Scale::Linear,
        None,
    )
}

fn kv(s: &mut String, k: &str, v: &str) {
    let _ = write!(s, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(v));
}

/// The self-contained HTML report.
pub fn html(r: &Report) -> String {
    let c = &r.config;
    let mut s = String::new();
    s.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Shoal bench report</title><style>\n");
    s.push_str("body{font-family:system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}th{background:#f4f4f4;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}.charts{display:flex;flex-wrap:wrap;gap:12px}.warn{color:#a40000}pre{background:#f8f8f8;padding:8px;font-size:12px;overflow:auto}h2{margin-top:32px}\n");
    s.push_str("</style></head><body>\n<h1>Shoal bench</h1>\n");
    let _ = writeln!(
        s,
        "<p>{} · Shoal {} · {} nodes · policy <b>{}</b> · {} engine</p>",
        esc(&c.started),
        esc(&c.shoal_version),
        c.nodes.len(),
        esc(&c.policy),
        esc(&c.engine)
    );
    let mut warns = r.warnings.clone();
    for p in &r.profiles {
        for run in &p.runs {
            for w in &run.warnings {
                warns.push(format!("{} on {}: {w}", p.profile.name, run.label()));
            }
        }
    }
    for w in &warns {
        let _ = writeln!(s, "<p class=\"warn\">WARNING: {}</p>", esc(w));
    }

    s.push_str("<h2>Results</h2>\n<table><tr><th>profile</th><th>target</th><th>engine</th><th>QD</th><th>IOPS</th><th>MB/s</th><th>avg ms</th><th>p50</th><th>p95</th><th>p99</th><th>p99.9</th><th>max</th><th>CPU s/kIO</th><th>Shoal ratio (IOPS)</th></tr>\n");
    for p in &r.profiles {
        for run in &p.runs {
            let ratio = p
                .ratios
                .iter()
                .find(|x| x.baseline == run.target && run.target != "shoal")
                .map(|x| format!("{:.2}x", x.iops))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td class=n>{}x{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td></tr>",
                esc(&p.profile.name),
                esc(&run.target),
                esc(&run.engine),
                run.outstanding,
                run.streams,
                group(run.iops),
                mbps(run.mbps),
                ms(run.lat.mean_us),
                ms(run.lat.p50_us),
                ms(run.lat.p95_us),
                ms(run.lat.p99_us),
                ms(run.lat.p999_us),
                ms(run.lat.max_us),
                run.cpu
                    .as_ref()
                    .map(|c| format!("{:.3}", c.seconds_per_kio))
                    .unwrap_or_else(|| "-".into()),
                ratio
            );
        }
    }
    s.push_str("</table>\n");

    for p in &r.profiles {
        let _ = writeln!(
            s,
            "<h2>{}</h2>\n<p>{}</p>\n<div class=\"charts\">{}{}</div>",
            esc(&p.profile.name),
            esc(&p.profile.describe()),
            latency_chart(p),
            iops_chart(p)
        );
        for run in &p.runs {
            if let Some(b) = &run.backend {
                if b.client_write_bytes > 0 {
                    let _ = writeln!(
                        s,
                        "<p>{}: client writes {:.1} MB, backend writes {:.1} MB (x{:.2}, {}), {} fdatasyncs ({:.1} per 1000 writes), {} requests forwarded to the owner</p>",
                        esc(&run.label()),
                        b.client_write_bytes as f64 / 1e6,
                        b.backend_write_bytes as f64 / 1e6,
                        b.amplification,
                        esc(&b.source),
                        b.device_syncs,
                        b.syncs_per_kwrite,
                        b.forwarded
                    );
                }
            }
            if let Some(cpu) = &run.cpu {
                let procs: Vec<String> = cpu
                    .processes
                    .iter()
                    .map(|(n, s)| format!("{n} {s:.2} s"))
                    .collect();
                let _ = writeln!(
                    s,
                    "<p>{}: CPU {:.2} s ({:.3} s per 1000 I/Os: {})</p>",
                    esc(&run.label()),
                    cpu.seconds,
                    cpu.seconds_per_kio,
                    esc(&procs.join(", "))
                );
            }
            if let Some(c) = &run.client_cpu {
                let _ = writeln!(
                    s,
                    "<p>{}: load generator CPU {:.2} s ({:.3} s per 1000 I/Os)</p>",
                    esc(&run.label()),
                    c.seconds,
                    c.seconds_per_kio
                );
            }
        }
        if let Some(lt) = &p.latency_target {
            let _ = writeln!(
                s,
                "<table><tr><th>QD</th><th>IOPS</th><th>p{} ms (target {})</th></tr>",
                lt.percentile,
                ms(lt.target_us)
            );
            for st in &lt.steps {
                let _ = writeln!(
                    s,
                    "<tr><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td></tr>",
                    st.outstanding,
                    group(st.iops),
                    ms(st.latency_us)
                );
            }
            s.push_str("</table>\n");
        }
    }

    s.push_str("<h2>Configuration</h2>\n<table>");
    kv(&mut s, "Shoal version", &c.shoal_version);
    kv(&mut s, "cluster", &c.cluster_id);
    kv(
        &mut s,
        "cluster size",
        &format!(
            "{} nodes, {} devices, {} raw capacity",
            c.nodes.len(),
            c.devices,
            shoal_model::human_size(c.device_capacity_bytes)
        ),
    );
    for n in &c.nodes {
        kv(
            &mut s,
            &format!("node {}", n.id),
            &format!("nbd {} api {} ({})", n.nbd_addr, n.api_addr, n.state),
        );
    }
    kv(
        &mut s,
        "policy",
        &format!(
            "{} ({} copies, {} witnesses, reserve {}%)",
            c.policy, c.copies, c.witnesses, c.reserve_pct
        ),
    );
    kv(&mut s, "checksums", if c.checksums { "on" } else { "off" });
    kv(
        &mut s,
        "placement",
        &c.placement
            .iter()
            .map(|(n, k)| format!("node {n}: {k} data copies"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    kv(&mut s, "store", &c.store);
    kv(&mut s, "engine", &c.engine);
    kv(
        &mut s,
        "load",
        &format!(
            "{} workers x {} volumes of {}",
            c.workers,
            c.volumes_per_worker,
            shoal_model::human_size(c.volume_size_bytes)
        ),
    );
    kv(
        &mut s,
        "preparation",
        &format!(
            "fill {} (compressibility {}%){}, {:.1} s",
            c.fill,
            c.compressibility_pct,
            if c.reused_volumes {
                ", volumes reused"
            } else {
                ""
            },
            c.fill_seconds
        ),
    );
    kv(
        &mut s,
        "timing",
        &format!(
            "{} s warm-up, {} s measured per profile{}",
            c.warmup_s,
            c.duration_s,
            if c.quick { " (quick)" } else { "" }
        ),
    );
    kv(&mut s, "CPU", &c.cpu);
    if let Some(f) = &c.baseline_file {
        kv(&mut s, "baseline file", f);
    }
    s.push_str("</table>\n");
    s.push_str("<h2>Profiles</h2>\n<table><tr><th>name</th><th>block</th><th>read %</th><th>random %</th><th>rate limit</th></tr>");
    for p in &r.profiles {
        let _ = write!(
            s,
            "<tr><td>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td></tr>",
            esc(&p.profile.name),
            esc(&shoal_model::human_size(p.profile.block_size)),
            p.profile.read_pct,
            p.profile.random_pct,
            p.profile
                .rate_limit
                .map(|x| x.to_string())
                .unwrap_or_else(|| "none".into())
        );
    }
    s.push_str("</table>\n");
    if !r.notes.is_empty() {
        s.push_str("<h2>Notes</h2><ul>");
        for n in &r.notes {
            let _ = write!(s, "<li>{}</li>", esc(n));
        }
        s.push_str("</ul>\n");
    }
    let _ = writeln!(s, "<h2>Table</h2><pre>{}</pre>", esc(&table(r)));
    s.push_str("</body></html>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hist::Lat;

    fn run(target: &str, engine: &str, iops: f64) -> Run {
        let mut h = Lat::new();
        for i in 1..=1000u64 {
            h.record(i * 1000);
        }
        Run {
            target: target.into(),
            engine: engine.into(),
            outstanding: 4,
            streams: 8,
            seconds: 5.0,
            iops,
            read_iops: iops,
            mbps: iops * 4096.0 / 1e6,
            lat: h.summary(),
            read_lat: h.summary(),
            distribution: h.distribution(),
            series: (1..=5)
                .map(|t| Sample {
                    t: t as f64,
                    iops: iops + t as f64,
                    mbps: 1.0,
                    lat_avg_us: 500.0,
                    lat_max_us: Some(900.0),
                })
                .collect(),
            cpu: Some(Cpu {
                processes: vec![("node1".into(), 1.5)],
                seconds: 1.5,
                seconds_per_kio: 0.012,
            }),
            ..Default::default()
        }
    }

    fn sample() -> Report {
        let p = crate::profile::easy_run().remove(0);
        Report {
            config: Config {
                shoal_version: "0.1.0".into(),
                policy: "raid1 ftt=1".into(),
                copies: 2,
                checksums: true,
                store: "thin, 1 MiB chunks <test>".into(),
                nodes: vec![NodeConf {
                    id: 1,
                    nbd_addr: "127.0.0.1:10809".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
            profiles: vec![ProfileResult {
                profile: p,
                runs: vec![
                    run("shoal", "native", 10_000.0),
                    run("shoal", "fio-nbd", 9_500.0),
                    run("raw-file", "fio-io_uring", 40_000.0),
                ],
                ratios: vec![Ratio {
                    baseline: "raw-file".into(),
                    iops: 0.25,
                    mbps: 0.25,
                    p99_latency: 1.0,
                }],
                latency_target: None,
            }],
            warnings: vec!["a resync ran".into()],
            notes: vec![],
        }
    }

    #[test]
    fn table_has_every_run_and_the_ratio() {
        let t = table(&sample());
        assert!(t.contains("4k-randread"), "{t}");
        assert!(t.contains("10,000"), "{t}");
        assert!(t.contains("shoal 0.25x"), "{t}");
        assert!(
            t.contains("native vs fio on 4k-randread: IOPS +5.3%"),
            "{t}"
        );
        assert!(t.contains("WARNING: a resync ran"), "{t}");
    }

    #[test]
    fn csv_has_a_header_and_one_row_per_run() {
        let c = csv(&sample());
        let lines: Vec<&str> = c.lines().collect();
        assert_eq!(lines.len(), 4);
        let cols = lines[0].split(',').count();
        assert!(lines.iter().all(|l| l.split(',').count() == cols));
        assert!(lines[3].contains("raw-file") && lines[3].contains("0.2500"));
        assert_eq!(csv_field("a,b"), "\"a,b\"");
    }

    #[test]
    fn html_is_self_contained_with_charts_and_config() {
        let h = html(&sample());
        assert!(h.starts_with("<!DOCTYPE html>"));
        assert_eq!(h.matches("<svg").count(), 2, "two charts per profile");
        assert!(h.contains("latency distribution") && h.contains("IOPS over time"));
        assert!(h.contains("<polyline"));
        assert!(h.contains("raid1 ftt=1") && h.contains("Shoal version") && h.contains("0.1.0"));
        assert!(h.contains("checksums") && h.contains("cluster size"));
        // escaped, no scripts, nothing fetched from elsewhere
        assert!(h.contains("&lt;test&gt;"));
        assert!(!h.contains("<script"));
        assert!(!h.contains("src="));
        assert!(!h.contains("href="));
        assert!(!h.contains("http://") && !h.contains("https://"));
        assert!(h.contains("WARNING: a resync ran"));
    }

    #[test]
    fn charts_handle_empty_and_flat_data() {
        let c = chart("t", "x", "y", &[], Scale::Log, None);
        assert!(c.contains("no data") && c.ends_with("</svg>"));
        let c = chart(
            "t",
            "x",
            "y",
            &[Line {
                name: "a".into(),
                points: vec![(1.0, 5.0), (1.0, 5.0)],
            }],
            Scale::Log,
            None,
        );
        assert!(c.contains("<polyline") && !c.contains("NaN") && !c.contains("inf"));
    }

    #[test]
    fn number_formats() {
        assert_eq!(group(1234567.4), "1,234,567");
        assert_eq!(group(999.0), "999");
        assert_eq!(ms(652.0), "0.652");
        assert_eq!(ms(12_345.0), "12.35");
        assert_eq!(ms(250_000.0), "250");
        assert_eq!(nice_ceiling(7.3), 10.0);
        assert_eq!(nice_ceiling(12_001.0), 20_000.0);
        assert_eq!(
            linear_ticks(56_000.0),
            (60_000.0, vec![0.0, 20_000.0, 40_000.0, 60_000.0])
        );
        assert_eq!(linear_ticks(3.0).1, vec![0.0, 1.0, 2.0, 3.0]);
        assert_eq!(linear_ticks(30.0).0, 30.0);
        assert!((nines(0.99) - 2.0).abs() < 1e-9);
        assert_eq!(nines(1.0), 5.5);
    }
}
