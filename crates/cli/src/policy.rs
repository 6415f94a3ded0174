//! `shoal volume set-policy`: a volume's policy changed in place
//! (`docs/reconfiguration.md`, Policy change). Says what the change adds
//! and drops and, with `--wait`, follows it until the owner commits it,
//! printing the volume's healing line and the copy in progress.

use crate::show;
use anyhow::{anyhow, bail, Context, Result};
use shoal_api::{Client, VolumeReport};
use shoal_model::{human_size, Component, ComponentRole, Policy, Volume};
use shoal_node::policy_change::{next_step, parse, reason};
use std::time::{Duration, Instant};

/// How often `--wait` asks for the volume.
const POLL: Duration = Duration::from_secs(1);
/// Least time between two lines on the same copy's progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Changes volume `name` to the policy `text`; with `wait`, waits that
/// long for the commit.
pub async fn set_policy(
    c: &Client,
    name: &str,
    text: &str,
    wait: Option<Duration>,
    json: bool,
) -> Result<()> {
    // Refused here, as the node would, before anything is asked.
    let policy = parse(text).map_err(|e| anyhow!("--policy {text:?}: {e}"))?;
    let before = c.volume(name).await?;
    let r = c
        .set_policy(name, text)
        .await
        .with_context(|| format!("changing the policy of volume {name}"))?;
    if !json {
        for line in plan_lines(&before.volume, &r.volume, &policy) {
            println!("{line}");
        }
    }
    let Some(timeout) = wait else {
        if json {
            println!("{}", serde_json::to_string_pretty(&r)?);
        }
        return Ok(());
    };
    let done = follow(c, name, &policy, timeout, json).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&done)?);
    } else {
        let v = &done.volume;
        let data = v.data_components().count();
        println!(
            "committed: volume {name} is {}: {data} data {}, {} {} ({})",
            v.policy,
            plural(data, "copy", "copies"),
            v.components.len() - data,
            plural(v.components.len() - data, "witness", "witnesses"),
            done.health
        );
    }
    Ok(())
}

fn plural<'a>(n: usize, one: &'a str, more: &'a str) -> &'a str {
    if n == 1 {
        one
    } else {
        more
    }
}

/// Whether `v` is in the change to `policy`, or in a step towards it.
fn in_change(v: &Volume, policy: &Policy) -> bool {
    v.reconfig.as_ref().is_some_and(|r| {
        (r.policy == Some(*policy) && r.reason == reason(policy))
            || v.wanted_policy == Some(*policy)
    })
}

/// The policies a change from `from` to `to` goes through, `to` last.
fn steps(from: &Policy, to: &Policy) -> Vec<Policy> {
    let mut out = Vec::new();
    let mut at = *from;
    while at != *to && out.len() < 4 {
        at = next_step(&at, to);
        out.push(at);
    }
    out
}

/// What the change does, for people: from `before` (the volume as it was)
/// to `after` (as the node answered, the change begun or already done).
fn plan_lines(before: &Volume, after: &Volume, policy: &Policy) -> Vec<String> {
    let name = &before.name;
    if before.policy == *policy && before.reconfig.is_none() {
        return vec![format!(
            "volume {name} has policy {policy} already: nothing to change"
        )];
    }
    let mut out = vec![format!("volume {name}: {} -> {policy}", before.policy)];
    let path = steps(&before.policy, policy);
    if path.len() > 1 {
        let names: Vec<String> = path.iter().map(|p| p.to_string()).collect();
        out.push(format!(
            "  in {} steps, each committed before the next: {}",
            path.len(),
            names.join(" -> ")
        ));
        out.push(format!("  step 1, to {}:", path[0]));
    }
    let added: Vec<&Component> = match &after.reconfig {
        Some(r) => after
            .components
            .iter()
            .filter(|c| r.added.contains(&c.id))
            .collect(),
        None => after
            .components
            .iter()
            .filter(|c| !before.components.iter().any(|b| b.id == c.id))
            .collect(),
    };
    let removed: Vec<&Component> = match &after.reconfig {
        Some(r) => before
            .components
            .iter()
            .filter(|c| r.remove.contains(&c.id))
            .collect(),
        None => before
            .components
            .iter()
            .filter(|c| !after.components.iter().any(|a| a.id == c.id))
            .collect(),
    };
    let what = |c: &Component| match c.role {
        ComponentRole::Data => "data copy".to_string(),
        r => r.to_string(),
    };
    for c in &added {
        out.push(format!(
            "  add  {:<9} component {} on node {} (device {})",
            what(c),
            c.id,
            c.node,
            c.device
        ));
    }
    for c in &removed {
        out.push(format!(
            "  drop {:<9} component {} on node {} (device {})",
            what(c),
            c.id,
            c.node,
            c.device
        ));
    }
    if added.is_empty() && removed.is_empty() {
        out.push("  no component moves: only the policy's other words change".into());
    }
    let copies = added
        .iter()
        .filter(|c| c.role == ComponentRole::Data)
        .count();
    let lowering = before.stripe.is_some()
        && after
            .reconfig
            .as_ref()
            .and_then(|r| r.policy)
            .is_some_and(|p| !p.layout.is_erasure());
    if in_change(after, policy) {
        out.push(if lowering {
            "begun: the owner reads every block the stripes hold back to the copies (while it \
             serves I/O), then commits and drops the stripe components"
                .to_string()
        } else if copies > 0 {
            format!(
                "begun: the owner copies the data ({} per copy at most) into the new {} \
                 while it serves I/O, then commits",
                human_size(before.size),
                plural(copies, "copy", "copies")
            )
        } else if added
            .iter()
            .any(|c| matches!(c.role, ComponentRole::Stripe { .. }))
        {
            "begun: the owner commits at once (the new stripe columns start empty), then \
             restarts as an erasure-coded owner and destages every block to stripes"
                .to_string()
        } else if !added.is_empty() {
            "begun: the owner commits once the new witnesses answer".to_string()
        } else {
            "begun: nothing to copy, the owner commits at once".to_string()
        });
    }
    out
}

/// Waits until the change to `policy` ends; answers the volume once it
/// is committed, fails if it was aborted or still runs after `timeout`.
async fn follow(
    c: &Client,
    name: &str,
    policy: &Policy,
    timeout: Duration,
    quiet: bool,
) -> Result<VolumeReport> {
    let start = Instant::now();
    let say = |line: String| {
        if quiet {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let (mut healing, mut progress) = (String::new(), None::<(u64, Instant)>);
    let mut told_aborted = false;
    // The volume's policy when a change was last seen in progress: a
    // change gone with the policy moved is a step committed, not aborted.
    let mut changing_from: Option<Policy> = None;
    loop {
        let error = match c.volume(name).await {
            Ok(r) if r.volume.policy == *policy => return Ok(r),
            Ok(r) if changing_from.is_some_and(|p| p != r.volume.policy) => {
                say(format!(
                    "step committed: volume {name} is {} now; the next step begins",
                    r.volume.policy
                ));
                changing_from = None;
                None
            }
            Ok(r) if !in_change(&r.volume, policy) && r.volume.wanted_policy == Some(*policy) => {
                // Between two steps, or aborted and still wanted: the
                // caretaker begins it (again).
                if !told_aborted && changing_from == Some(r.volume.policy) {
                    told_aborted = true;
                    say(
                        "the change was aborted (an added copy could not be brought in); the \
                         volume's caretaker begins it again"
                            .to_string(),
                    );
                }
                None
            }
            Ok(r) if !in_change(&r.volume, policy) => {
                bail!(
                    "the change of volume {name} to {policy} ended without it (aborted, then \
                     another policy was asked for); the volume keeps {}",
                    r.volume.policy
                );
            }
            Ok(r) => {
                changing_from = Some(r.volume.policy);
                if r.healing != healing {
                    healing = r.healing.clone();
                    say(format!("healing: {healing}"));
                }
                if let Some(x) = &r.resync {
                    let due = progress.is_none_or(|(comp, at)| {
                        comp != x.component || at.elapsed() >= PROGRESS_EVERY
                    });
                    if due {
                        progress = Some((x.component, Instant::now()));
                        say(format!("copying: {}", show::resync_line(x)));
                    }
                }
                None
            }
            Err(e) => Some(e.to_string()),
        };
        if start.elapsed() >= timeout {
            let why = error
                .map(|e| format!(" (last answer: {e})"))
                .unwrap_or_default();
            bail!(
                "the change of volume {name} to {policy} is still in progress after {} s{why}: \
                 follow it with `shoal volume show {name}`",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_model::{ComponentState, Reconfig};

    fn comp(id: u64, role: ComponentRole, node: u64) -> Component {
        Component {
            id,
            role,
            node,
            device: node,
            state: ComponentState::Active,
            votes: 1,
        }
    }

    fn vol(policy: &str, comps: Vec<Component>) -> Volume {
        Volume {
            id: 1,
            name: "v".into(),
            size: 128 << 20,
            policy: policy.parse().unwrap(),
            components: comps,
            owner: None,
            generation: 1,
            problem: None,
            wrapped_key: None,
            reconfig: None,
            wanted_policy: None,
            grow_to: None,
            map_log_at: None,
            stripe: None,
        }
    }

    #[test]
    fn the_plan_names_what_is_added_and_dropped() {
        use ComponentRole::{Data, Witness};
        let before = vol(
            "raid1 ftt=1",
            vec![comp(1, Data, 1), comp(2, Data, 2), comp(3, Witness, 3)],
        );
        let new: Policy = "raid1 ftt=2".parse().unwrap();
        let mut after = before.clone();
        after.components.push(comp(7, Data, 4));
        after.components.push(comp(8, Witness, 5));
        after.reconfig = Some(Reconfig {
            reason: reason(&new),
            added: vec![7, 8],
            remove: vec![],
            policy: Some(new),
        });
        let lines = plan_lines(&before, &after, &new);
        assert_eq!(lines[0], "volume v: raid1 ftt=1 -> raid1 ftt=2");
        assert_eq!(
            lines[1],
            "  add  data copy component 7 on node 4 (device 4)"
        );
        assert_eq!(
            lines[2],
            "  add  witness   component 8 on node 5 (device 5)"
        );
        assert!(lines[3].contains("128 MiB per copy"), "{}", lines[3]);
        assert!(in_change(&after, &new));
        // Down: the copy and the witness dropped.
        let zero: Policy = "ftt=0".parse().unwrap();
        let mut after = before.clone();
        after.reconfig = Some(Reconfig {
            reason: reason(&zero),
            added: vec![],
            remove: vec![2, 3],
            policy: Some(zero),
        });
        let lines = plan_lines(&before, &after, &zero);
        assert_eq!(
            lines[1],
            "  drop data copy component 2 on node 2 (device 2)"
        );
        assert_eq!(
            lines[2],
            "  drop witness   component 3 on node 3 (device 3)"
        );
        // Already there.
        let same: Policy = "raid1 ftt=1".parse().unwrap();
        let lines = plan_lines(&before, &before, &same);
        assert_eq!(
            lines,
            vec!["volume v has policy raid1 ftt=1 already: nothing to change"]
        );
        // Only another word: committed at once, nothing moves.
        let iops: Policy = "raid1 ftt=1 iops=50".parse().unwrap();
        let mut after = before.clone();
        after.policy = iops;
        let lines = plan_lines(&before, &after, &iops);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[1].contains("no component moves"), "{lines:?}");
    }
}
