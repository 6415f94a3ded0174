//! `shoal bench --policies`: the same profiles on several policies of one
//! cluster, side by side, each with its ratio to the first (as the reviews
//! of vSAN compare RAID-1 and RAID-5 on the same hosts).

use crate::report::{Report, Run};
use anyhow::{bail, Result};
use shoal_model::Policy;

/// Most policies one comparison runs: each runs every profile.
pub const MAX_POLICIES: usize = 8;

/// The policies of `--policies`, each checked by the policy parser.
pub fn policies(list: &str) -> Result<Vec<String>> {
    let out: Vec<String> = list
        .split(',')
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty())
        .collect();
    if out.len() < 2 {
        bail!(
            "--policies needs at least two policies, comma-separated (e.g. \"raid1 ftt=1,raid5\")"
        );
    }
    if out.len() > MAX_POLICIES {
        bail!("--policies compares at most {MAX_POLICIES} policies");
    }
    for p in &out {
        if let Err(e) = p.parse::<Policy>() {
            bail!("--policies: {p:?}: {e}");
        }
    }
    Ok(out)
}

/// The folder of one policy's results: its words joined by `-`.
pub fn folder(policy: &str) -> String {
    let words: Vec<String> = policy
        .split(|c: char| c.is_whitespace())
        .filter(|w| !w.is_empty())
        .map(|w| w.replace(|c: char| !c.is_ascii_alphanumeric(), "_"))
        .collect();
    format!("policy-{}", words.join("-"))
}

/// Shoal's run of `profile` in `r` (the first engine's).
fn shoal_run<'a>(r: &'a Report, profile: &str) -> Option<&'a Run> {
    r.profiles
        .iter()
        .find(|p| p.profile.name == profile)?
        .runs
        .iter()
        .find(|run| run.target == "shoal")
}

/// CPU seconds of the node processes per 1,000 I/Os, if measured.
fn cpu(run: &Run) -> Option<f64> {
    run.cpu.as_ref().map(|c| c.seconds_per_kio)
}

/// One row per profile and policy: IOPS, p99, CPU per 1,000 I/Os, and the
/// ratios to the first policy (IOPS: higher is better; CPU: lower).
fn rows(reports: &[(String, Report)]) -> Vec<[String; 7]> {
    let Some((_, first)) = reports.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in &first.profiles {
        let name = &p.profile.name;
        let base = shoal_run(first, name);
        for (policy, r) in reports {
            let Some(run) = shoal_run(r, name) else {
                continue;
            };
            let ratio = |x: Option<f64>, b: Option<f64>| match (x, b) {
                (Some(x), Some(b)) if b > 0.0 => format!("{:.2}", x / b),
                _ => "-".into(),
            };
            out.push([
                name.clone(),
                policy.clone(),
                format!("{:.0}", run.iops),
                format!("{:.0}", run.lat.p99_us),
                cpu(run).map_or("-".into(), |c| format!("{c:.3}")),
                ratio(Some(run.iops), base.map(|b| b.iops)),
                ratio(cpu(run), base.and_then(cpu)),
            ]);
        }
    }
    out
}

const HEADER: [&str; 7] = [
    "profile",
    "policy",
    "IOPS",
    "p99 us",
    "CPU s/kIO",
    "IOPS ratio",
    "CPU ratio",
];

/// The comparison as a text table.
pub fn table(reports: &[(String, Report)]) -> String {
    let rows = rows(reports);
    let mut width = HEADER.map(str::len);
    for r in &rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: &[String]| {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(width).enumerate() {
            match i {
                0 | 1 => s.push_str(&format!("{c:<w$}  ")),
                _ => s.push_str(&format!("{c:>w$}  ")),
            }
        }
        s.trim_end().to_string()
    };
    let first = reports.first().map_or("", |(p, _)| p.as_str());
    let mut out = format!("Policies side by side (ratios to \"{first}\"):\n");
    out.push_str(&line(&HEADER.map(String::from)));
    out.push('\n');
    for r in &rows {
        out.push_str(&line(r));
        out.push('\n');
    }
    out
}

/// The comparison as CSV.
pub fn csv(reports: &[(String, Report)]) -> String {
    let mut out = HEADER.join(",");
    out.push('\n');
    for r in rows(reports) {
        let cells: Vec<String> = r.iter().map(|c| format!("\"{c}\"")).collect();
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_are_checked_and_named() {
        assert_eq!(
            policies("raid1 ftt=1, raid5").unwrap(),
            vec!["raid1 ftt=1".to_string(), "raid5".to_string()]
        );
        assert!(policies("raid1").is_err());
        assert!(policies("raid1,raid7")
            .unwrap_err()
            .to_string()
            .contains("raid7"));
        assert!(policies(&["raid1"; 9].join(",")).is_err());
        assert_eq!(folder("raid1 ftt=1"), "policy-raid1-ftt_1");
    }

    #[test]
    fn ratios_are_to_the_first_policy() {
        let report = |iops: f64| {
            let mut r = Report::default();
            let run = Run {
                target: "shoal".into(),
                iops,
                ..Default::default()
            };
            r.profiles.push(crate::report::ProfileResult {
                profile: crate::profile::builtins()[0].clone(),
                runs: vec![run],
                ratios: Vec::new(),
                latency_target: None,
            });
            r
        };
        let t = table(&[
            ("raid1".into(), report(1000.0)),
            ("raid5".into(), report(950.0)),
        ]);
        assert!(t.contains("0.95"), "{t}");
        assert!(t.contains("1.00"), "{t}");
    }
}
