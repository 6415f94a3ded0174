//! Tables for people.

use shoal_api::{CapacityReport, ResyncKind, ResyncReport, StatusReport, VolumeReport};
use shoal_model::human_size;

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
            d.shown_state(),
            human_size(d.capacity),
            human_size(d.used),
            human_size(d.free()),
            d.path
        );
    }
    println!();
    volumes(&s.volumes);
    if let Some(c) = &s.capacity {
        println!();
        println!("volumes in all: {}", capacity_line(c));
    }
}

/// "1 GiB; 512 MiB written; 1 GiB on devices (2.00x written)".
pub fn capacity_line(c: &CapacityReport) -> String {
    let known = |b: Option<u64>| b.map_or("unknown".to_string(), human_size);
    let overhead = c
        .overhead()
        .map(|o| format!(" ({o:.2}x written)"))
        .unwrap_or_default();
    format!(
        "{}; {} written; {} on devices{overhead}",
        human_size(c.size_bytes),
        known(c.written_bytes),
        known(c.used_bytes)
    )
}

pub fn volumes(v: &[VolumeReport]) {
    println!(
        "{:<20} {:>10} {:>10} {:>10} {:>8} {:<22} {:<6} HEALTH",
        "VOLUME", "SIZE", "WRITTEN", "ON DEVICES", "OVERHEAD", "POLICY", "OWNER"
    );
    for r in v {
        let c = r.capacity.unwrap_or_default();
        let known = |b: Option<u64>| b.map_or("-".to_string(), human_size);
        println!(
            "{:<20} {:>10} {:>10} {:>10} {:>8} {:<22} {:<6} {}",
            r.volume.name,
            human_size(r.volume.size),
            known(c.written_bytes),
            known(c.used_bytes),
            c.overhead().map_or("-".to_string(), |o| format!("{o:.2}x")),
            r.volume.policy.to_string(),
            r.volume
                .owner
                .map(|o| o.to_string())
                .unwrap_or_else(|| "-".into()),
            healing_of(r)
        );
    }
}

/// The healing line of a report (from a node that has none: its health).
fn healing_of(r: &VolumeReport) -> String {
    match r.healing.as_str() {
        "" => r.health.to_string(),
        h => h.to_string(),
    }
}

pub fn volume(r: &VolumeReport) {
    let v = &r.volume;
    println!("volume      {}", v.name);
    println!("size        {} ({} bytes)", human_size(v.size), v.size);
    if let Some(to) = v.grow_to {
        println!(
            "growing to  {} ({to} bytes): its owner moves the map log past the new end, then \
             commits the size",
            human_size(to)
        );
    }
    println!("policy      {}", v.policy);
    if let Some(g) = v.stripe {
        println!(
            "layout      {} copies and {} witnesses (performance leg) in front of {g} stripes \
             over {} stripe components (capacity leg)",
            v.policy.copies(),
            v.policy.witnesses(),
            g.width()
        );
    }
    match (&v.wanted_policy, &v.reconfig) {
        (Some(w), None) => println!(
            "wanted      {w} (a step towards it committed, or its change ended without it: \
             the volume's caretaker begins the next step or the change again; `set-policy` \
             with the policy above keeps that one)"
        ),
        (Some(w), Some(_)) => println!("wanted      {w} (changing now)"),
        (None, _) => {}
    }
    if let Some(c) = &r.capacity {
        println!("capacity    {}", capacity_line(c));
    }
    println!("checksums   CRC-32C of every block, checked on every read and by the scrubber");
    println!("iops limit  {}", iops_line(r));
    println!("health      {}", r.health);
    println!("healing     {}", healing_of(r));
    if let Some(x) = &r.resync {
        println!("resync      {}", resync_line(x));
    }
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
            c.role.to_string(),
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

/// A copy being brought up to date, for people: "component 14
/// (rebuild): 30 MiB of 100 MiB copied, 10 MiB/s, 7s left".
pub fn resync_line(x: &ResyncReport) -> String {
    let kind = match x.kind {
        ResyncKind::Rebuild => "rebuild",
        ResyncKind::Resync => "resync",
    };
    let eta = match x.eta_s {
        Some(s) => format!("{} left", human_eta(s)),
        None => "time left not known yet".into(),
    };
    format!(
        "component {} ({kind}): {} of {} copied, {}/s, {eta}",
        x.component,
        human_size(x.bytes_copied),
        human_size(x.bytes_to_copy),
        human_size(x.rate_bytes_per_s),
    )
}

/// Seconds as `45s`, `2m 05s`, `1h 02m`, `3d 04h`: the two largest units.
fn human_eta(s: u64) -> String {
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {:02}h", s / 86400, s % 86400 / 3600),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resync_reads_in_human_units() {
        let mut x = ResyncReport {
            component: 14,
            kind: ResyncKind::Rebuild,
            bytes_to_copy: 100 << 20,
            bytes_copied: 30 << 20,
            rate_bytes_per_s: 10 << 20,
            eta_s: Some(7),
        };
        assert_eq!(
            resync_line(&x),
            "component 14 (rebuild): 30 MiB of 100 MiB copied, 10 MiB/s, 7s left"
        );
        x.kind = ResyncKind::Resync;
        x.eta_s = None;
        assert!(resync_line(&x).contains("(resync)"));
        assert!(resync_line(&x).ends_with("time left not known yet"));
    }

    #[test]
    fn times_left_keep_their_two_largest_units() {
        assert_eq!(human_eta(0), "0s");
        assert_eq!(human_eta(59), "59s");
        assert_eq!(human_eta(125), "2m 05s");
        assert_eq!(human_eta(3720), "1h 02m");
        assert_eq!(human_eta(3 * 86400 + 4 * 3600 + 5), "3d 04h");
    }
}
