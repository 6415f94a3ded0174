//! `shoal maintenance enter|exit|status` and `shoal cluster remove-node`:
//! a node's maintenance mode (vSAN's three modes) and its removal, through
//! any node's REST API (`docs/reconfiguration.md`, Maintenance mode).

use crate::{local, Target};
use anyhow::{Context, Result};
use clap::Subcommand;
use shoal_api::MaintenanceReport;
use shoal_model::MaintenanceMode;

#[derive(Subcommand)]
pub enum MaintenanceCmd {
    /// Put a node in maintenance: placement puts nothing new on it, and
    /// the mode's components move off it (one change of layout per
    /// volume, under I/O). Refused, changing nothing, when the mode would
    /// leave a volume inaccessible or a replacement has no place; the
    /// refusal names each volume. Entering again changes the mode (and
    /// resumes moves left waiting).
    Enter {
        /// The node's id.
        node: u64,
        /// ensure-accessibility (move what the volumes need to stay
        /// accessible without the node: ftt=0 copies, and copies of
        /// volumes already missing a component), full-data-migration
        /// (move everything: before removing the node), or
        /// no-data-migration (move nothing).
        #[arg(long, value_parser = parse_mode)]
        mode: MaintenanceMode,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Take a node out of maintenance: moves already begun finish,
    /// nothing moves back.
    Exit {
        node: u64,
        #[command(flatten)]
        target: Target,
    },
    /// Nodes in maintenance (or one node): the mode, the components still
    /// to move off it, "ready" when none is left.
    Status {
        node: Option<u64>,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
}

fn parse_mode(s: &str) -> Result<MaintenanceMode, String> {
    s.parse()
}

pub async fn run(cmd: MaintenanceCmd) -> Result<()> {
    match cmd {
        MaintenanceCmd::Enter {
            node,
            mode,
            target,
            json,
        } => {
            let r = local::client(&target)?
                .enter_maintenance(node, mode)
                .await
                .with_context(|| format!("putting node {node} in maintenance"))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                if !r.begun.is_empty() {
                    println!("moving off node {node}: {}", r.begun.join(", "));
                }
                if !r.waiting.is_empty() {
                    println!(
                        "waiting for another change to end first: {}",
                        r.waiting.join(", ")
                    );
                }
                println!("{}", line(&r.report));
            }
        }
        MaintenanceCmd::Exit { node, target } => {
            local::client(&target)?
                .exit_maintenance(node)
                .await
                .with_context(|| format!("taking node {node} out of maintenance"))?;
            println!("node {node}: out of maintenance");
        }
        MaintenanceCmd::Status { node, target, json } => {
            let c = local::client(&target)?;
            let rs = match node {
                Some(n) => vec![c.node_maintenance(n).await?],
                None => c.maintenance().await?,
            };
            if json {
                match (node, rs.first()) {
                    (Some(_), Some(r)) => println!("{}", serde_json::to_string_pretty(r)?),
                    _ => println!("{}", serde_json::to_string_pretty(&rs)?),
                }
            } else if rs.is_empty() {
                println!("no node is in maintenance");
            } else {
                for r in &rs {
                    println!("{}", line(r));
                }
            }
        }
    }
    Ok(())
}

/// `shoal cluster remove-node ID`.
pub async fn remove_node(node: u64, target: &Target) -> Result<()> {
    let r = local::client(target)?
        .remove_node(node)
        .await
        .with_context(|| format!("removing node {node}"))?;
    let voter = if r.was_voter {
        " and from the directory's voters"
    } else {
        ""
    };
    println!(
        "node {node}: removed from the cluster{voter}; its certificates are revoked \
         (stop its process; it comes back only by joining anew)"
    );
    Ok(())
}

/// One node's maintenance for people.
fn line(r: &MaintenanceReport) -> String {
    let Some(mode) = r.mode else {
        return format!("node {}: not in maintenance", r.node);
    };
    let mut s = format!("node {}: {mode}: ", r.node);
    if r.ready {
        s.push_str("ready");
    } else {
        s.push_str(&format!(
            "{} component(s) to move (volumes {})",
            r.components_to_move,
            r.volumes.join(", ")
        ));
        if !r.changing.is_empty() {
            s.push_str(&format!("; changing now: {}", r.changing.join(", ")));
        }
    }
    match r.components_on_node {
        0 => s.push_str("; holds nothing (it can be removed)"),
        n if r.ready => s.push_str(&format!("; {n} component(s) stay on it")),
        _ => {}
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(mode: Option<MaintenanceMode>, to_move: usize, on: usize) -> MaintenanceReport {
        MaintenanceReport {
            node: 3,
            mode,
            components_to_move: to_move,
            volumes: if to_move > 0 {
                vec!["a".into()]
            } else {
                vec![]
            },
            changing: vec![],
            components_on_node: on,
            ready: mode.is_some() && to_move == 0,
        }
    }

    #[test]
    fn status_lines_say_what_is_left() {
        use MaintenanceMode::*;
        assert_eq!(line(&report(None, 0, 2)), "node 3: not in maintenance");
        assert_eq!(
            line(&report(Some(FullDataMigration), 1, 1)),
            "node 3: full-data-migration: 1 component(s) to move (volumes a)"
        );
        assert_eq!(
            line(&report(Some(FullDataMigration), 0, 0)),
            "node 3: full-data-migration: ready; holds nothing (it can be removed)"
        );
        assert_eq!(
            line(&report(Some(EnsureAccessibility), 0, 1)),
            "node 3: ensure-accessibility: ready; 1 component(s) stay on it"
        );
        assert_eq!(parse_mode("no-data-migration"), Ok(NoDataMigration));
        assert!(parse_mode("full").is_err());
    }
}
