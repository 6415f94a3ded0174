//! `shoal device add|remove|keep|show`: a node's devices while it runs, through
//! any node's REST API (`docs/reconfiguration.md`, Adding and removing
//! devices).

use crate::{local, Target};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use shoal_api::{AddDevice, ApiError, DeviceRemoval};
use std::time::Duration;

/// Seconds between two looks at a removal in progress.
const POLL_S: u64 = 1;

#[derive(Subcommand)]
pub enum DeviceCmd {
    /// Open a device on a running node and serve it at once: a block
    /// device or a file, formatted when it is new or all zeros at its
    /// start (anything else that is not a device of this cluster is
    /// refused, not formatted).
    Add {
        /// The node's id.
        node: u64,
        /// Absolute path on that node.
        path: String,
        /// Size of a file to create (e.g. 4G); an existing file or block
        /// device keeps its own.
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        /// Create the file written in full (zeros) rather than sparse.
        #[arg(long)]
        thick: bool,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Remove a device: its components move off it (one change of layout
    /// per volume, under I/O), then its node closes it and it leaves the
    /// cluster. Waits until it has left, showing what is left to move;
    /// interrupting the wait does not stop the removal. Refused, changing
    /// nothing, for a node's last device or a component with nowhere to go.
    Remove {
        /// The device's id (`shoal status`).
        id: u64,
        #[command(flatten)]
        target: Target,
    },
    /// Call a device's removal off while it still holds components: the
    /// moves already begun go on, and new components may be placed on it
    /// again. Refused once it holds none (its node is closing it).
    Keep {
        id: u64,
        #[command(flatten)]
        target: Target,
    },
    /// A device and what its removal still waits for.
    Show {
        id: u64,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
}

fn parse_size(s: &str) -> Result<u64, String> {
    shoal_model::parse_size(s).map_err(|e| e.to_string())
}

/// One line about a device's removal.
fn line(r: &DeviceRemoval) -> String {
    let what = if r.retiring {
        "being removed"
    } else {
        "in service"
    };
    let mut s = format!(
        "device {} ({} on node {}): {what}, {} component(s) on it",
        r.device, r.path, r.node, r.components
    );
    if !r.volumes.is_empty() {
        s += &format!(" (volumes {})", r.volumes.join(", "));
    }
    if !r.changing.is_empty() {
        s += &format!("; moving now: {}", r.changing.join(", "));
    }
    if let Some(b) = &r.blocked {
        s += &format!("; waiting: {b}");
    }
    s
}

pub async fn run(cmd: DeviceCmd) -> Result<()> {
    match cmd {
        DeviceCmd::Add {
            node,
            path,
            size,
            thick,
            target,
            json,
        } => {
            let req = AddDevice {
                node,
                path: path.clone(),
                size_bytes: size,
                thick,
            };
            let r = local::client(&target)?
                .add_device(&req)
                .await
                .with_context(|| format!("adding {path} to node {node}"))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!(
                    "device {}: {} on node {}, {} usable",
                    r.device,
                    r.path,
                    r.node,
                    shoal_model::human_size(r.capacity)
                );
            }
        }
        DeviceCmd::Remove { id, target } => remove(id, &target).await?,
        DeviceCmd::Keep { id, target } => {
            let r = local::client(&target)?
                .keep_device(id)
                .await
                .with_context(|| format!("keeping device {id}"))?;
            println!("{}", line(&r));
        }
        DeviceCmd::Show { id, target, json } => {
            let r = local::client(&target)?.device(id).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!("{}", line(&r));
            }
        }
    }
    Ok(())
}

/// Begins the removal and follows it until the device has left.
async fn remove(id: u64, target: &Target) -> Result<()> {
    let c = local::client(target)?;
    let r = c
        .remove_device(id)
        .await
        .with_context(|| format!("removing device {id}"))?;
    println!("{}", line(&r));
    let mut said = line(&r);
    loop {
        tokio::time::sleep(Duration::from_secs(POLL_S)).await;
        match c.device(id).await {
            Ok(r) => {
                let now = line(&r);
                if now != said {
                    println!("{now}");
                    said = now;
                }
                if !r.retiring {
                    bail!("device {id} is in service again: its removal was undone");
                }
            }
            Err(ApiError::NotFound(_)) => {
                println!("device {id} removed");
                return Ok(());
            }
            Err(e) => return Err(e).context(format!("following the removal of device {id}")),
        }
    }
}
