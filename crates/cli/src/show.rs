//! Tables for people.

use shoal_api::{StatusReport, VolumeReport};
use shoal_model::{human_size, ComponentRole};

pub fn status(s: &StatusReport) {
    println!(
        "cluster {}  leader node {}  voters {:?}",
        s.cluster_id,
        s.leader
            .map(|l| l.to_string())
            .unwrap_or_else(|| "none".into()),
        s.voters
    );
    println!();
    println!(
        "{:<5} {:<6} {:<14} {:<22} {:<22}",
        "NODE", "STATE", "FAULT DOMAIN", "NBD", "API"
    );
    for n in &s.nodes {
        println!(
            "{:<5} {:<6} {:<14} {:<22} {:<22}",
            n.id,
            n.state.to_string(),
            n.fault_domain,
            n.nbd_addr,
            n.api_addr
        );
    }
    println!();
    println!(
        "{:<7} {:<5} {:<10} {:>10} {:>10} {:>10}  PATH",
        "DEVICE", "NODE", "STATE", "CAPACITY", "USED", "FREE"
    );
    for d in &s.devices {
        println!(
            "{:<7} {:<5} {:<10} {:>10} {:>10} {:>10}  {}",
            d.id,
            d.node,
            format!("{:?}", d.state).to_lowercase(),
            human_size(d.capacity),
            human_size(d.used),
            human_size(d.free()),
            d.path
        );
    }
    println!();
    volumes(&s.volumes);
}

pub fn volumes(v: &[VolumeReport]) {
    println!(
        "{:<20} {:>10} {:<22} {:<22} {:<6}",
        "VOLUME", "SIZE", "POLICY", "HEALTH", "OWNER"
    );
    for r in v {
        println!(
            "{:<20} {:>10} {:<22} {:<22} {:<6}",
            r.volume.name,
            human_size(r.volume.size),
            r.volume.policy.to_string(),
            r.health.to_string(),
            r.volume
                .owner
                .map(|o| o.to_string())
                .unwrap_or_else(|| "-".into())
        );
    }
}

pub fn volume(r: &VolumeReport) {
    let v = &r.volume;
    println!("volume      {}", v.name);
    println!("size        {} ({} bytes)", human_size(v.size), v.size);
    println!("policy      {}", v.policy);
    println!("checksums   CRC-32C of every block, checked on every read and by the scrubber");
    println!("iops limit  {}", iops_line(r));
    println!("health      {}", r.health);
    println!(
        "owner       {} (generation {})",
        v.owner
            .map(|o| format!("node {o}"))
            .unwrap_or_else(|| "none".into()),
        v.generation
    );
    println!("components:");
    println!(
        "  {:<6} {:<8} {:<5} {:<7} {:<10} VOTES",
        "ID", "ROLE", "NODE", "DEVICE", "STATE"
    );
    for c in &v.components {
        println!(
            "  {:<6} {:<8} {:<5} {:<7} {:<10} {}",
            c.id,
            match c.role {
                ComponentRole::Data => "data",
                ComponentRole::Witness => "witness",
            },
            c.node,
            c.device,
            c.state.to_string(),
            c.votes
        );
    }
    println!("uris:");
    for u in &r.uris {
        println!("  {u}");
    }
}

/// The volume's IOPS limit and what it held back, as its owner counts it.
fn iops_line(r: &VolumeReport) -> String {
    let limit = match r.volume.policy.iops_limit {
        0 => "none".to_string(),
        n => format!("{n} (32 KiB units, reads and writes together)"),
    };
    match &r.throttle {
        Some(t) => format!(
            "{limit}; throttled {} I/Os for {:.1} s in all on owner node {}",
            t.throttled_ios,
            t.throttled_us as f64 / 1e6,
            t.node
        ),
        None => limit,
    }
}
