//! Delta resync on the partition harness (issue 23): a host cut off from
//! the cluster, not killed, while the volume is written, gets back only
//! the regions written meanwhile, not its whole copy; the copies agree
//! and the data read back is what was acknowledged. While it is cut off,
//! its copy still counts once in `shoal_components` over the others.

mod common;

use common::netns::{Nemesis, NetCluster};
use common::require;
use std::time::Duration;

const VOL: &str = "v";
const MIB: u64 = 1 << 20;
/// The volume's size and what is written before the cut: all of it, so
/// that a full copy would move every byte.
const SIZE_MIB: u64 = 128;
/// What is written while the host is cut off, sequentially, in MiB.
const WRITTEN_MIB: u64 = 8;
/// Longest the healed cluster may take to resync the copy.
const HEAL: Duration = Duration::from_secs(90);

#[test]
fn a_host_back_before_the_repair_delay_gets_only_the_regions_written_meanwhile() {
    require("qemu-io");
    let c = NetCluster::start(4);
    let size = format!("{SIZE_MIB}M");
    c.shoal(
        1,
        1,
        &[
            "volume",
            "create",
            VOL,
            "--size",
            &size,
            "--policy",
            "raid1 ftt=1",
        ],
    )
    .expect("creating the volume");
    // Filled through node 1, which then owns the volume.
    let fill: Vec<String> = (0..SIZE_MIB / 32)
        .map(|i| format!("write -P 0xa1 {}M 32M", i * 32))
        .collect();
    let fill: Vec<&str> = fill.iter().map(String::as_str).collect();
    c.qemu_io(1, 1, VOL, &fill).expect("filling the volume");
    let layout = c.layout(VOL, 1).expect("the layout");
    assert_eq!(
        layout.owner,
        Some(1),
        "node 1 owns the volume: {}",
        layout.components
    );
    let cut = *layout
        .data
        .iter()
        .find(|&&n| n != 1)
        .unwrap_or_else(|| panic!("a data copy off node 1: {}", layout.components));
    let before = c
        .metric(cut, "shoal_resync_bytes_total")
        .expect("the metric");
    // The fill's last writes are settled on the host to be cut (the
    // owner's next barrier): it would report their regions otherwise.
    common::wait_for("the fill settled on the host to cut", HEAL, || {
        match c.metric(cut, "shoal_unsettled_regions")? {
            0 => Ok(()),
            n => Err(format!("{n} regions unsettled")),
        }
    });

    let nemesis = c.hosts.start(Nemesis::Isolate(cut));
    // Acknowledged only once the cut copy is recorded absent.
    let at = SIZE_MIB / 2;
    let write = format!("write -P 0x5d {at}M {WRITTEN_MIB}M");
    c.qemu_io(1, 1, VOL, &[&write])
        .expect("writing while the host is cut off");
    // The cut host's copy still counts once in `shoal_components` summed
    // over the hosts that answer (the directory's leader reports it).
    let live: Vec<u32> = (1..=4).filter(|&n| n != cut).collect();
    common::wait_for("every component counted once", HEAL, || {
        let n: u64 = live
            .iter()
            .map(|&h| c.metric(h, "shoal_components"))
            .sum::<Result<u64, String>>()?;
        if n == 3 {
            Ok(())
        } else {
            Err(format!(
                "{n} components counted over nodes {live:?}, 3 placed"
            ))
        }
    });
    nemesis.heal();

    let took = c
        .wait_healthy(VOL, 1, HEAL)
        .unwrap_or_else(|e| panic!("{e}"));
    println!("healthy {:.1} s after the heal", took.as_secs_f64());
    let copied = c
        .metric(cut, "shoal_resync_bytes_total")
        .expect("the metric")
        - before;
    println!(
        "resync copied {:.1} MiB for {WRITTEN_MIB} MiB written ({:.2}x); a full copy is {SIZE_MIB} MiB",
        copied as f64 / MIB as f64,
        copied as f64 / (WRITTEN_MIB * MIB) as f64
    );
    assert!(
        copied >= WRITTEN_MIB * MIB,
        "the regions written must be copied: {copied} bytes"
    );
    assert!(
        copied <= 2 * WRITTEN_MIB * MIB,
        "only the regions written (region granularity allowed): {copied} bytes"
    );
    c.verify(VOL, 1).unwrap_or_else(|e| panic!("{e}"));
    let written = format!("read -P 0x5d {at}M {WRITTEN_MIB}M");
    let kept = format!("read -P 0xa1 0 {at}M");
    c.qemu_io(1, 1, VOL, &[&written, &kept])
        .unwrap_or_else(|e| panic!("reading back: {e}"));
}

/// The repair delay of the rebuild test: short, so that the cut host's
/// copy is rebuilt elsewhere within the test.
const REPAIR_DELAY: &str = "3s";

#[test]
fn a_host_cut_past_the_repair_delay_is_rebuilt_elsewhere_and_its_copy_discarded_on_return() {
    require("qemu-io");
    let c = NetCluster::start(4);
    c.shoal(1, 1, &["cluster", "set", "repair-delay", REPAIR_DELAY])
        .expect("setting the repair delay");
    c.shoal(
        1,
        1,
        &[
            "volume",
            "create",
            VOL,
            "--size",
            "32M",
            "--policy",
            "raid1 ftt=1",
        ],
    )
    .expect("creating the volume");
    c.qemu_io(1, 1, VOL, &["write -P 0xa1 0 32M"])
        .expect("filling the volume");
    let layout = c.layout(VOL, 1).expect("the layout");
    let cut = *layout
        .data
        .iter()
        .find(|&&n| n != 1)
        .unwrap_or_else(|| panic!("a data copy off node 1: {}", layout.components));
    let nemesis = c.hosts.start(Nemesis::Isolate(cut));
    c.qemu_io(1, 1, VOL, &["write -P 0x5d 8M 4M"])
        .expect("writing while the host is cut off");
    // The cut copy is replaced while its host is still cut off.
    common::poll_for(HEAL, || {
        let l = c.layout(VOL, 1)?;
        let replaced = !l.data.contains(&cut) && l.data.len() == layout.data.len();
        match c.health(VOL, 1)? {
            h if h == "Healthy" && replaced => Ok(()),
            h => Err(format!("{h}: {}", l.components)),
        }
    })
    .unwrap_or_else(|e| panic!("the cut copy rebuilt elsewhere: {e}"));
    nemesis.heal();
    // Back, the host finds its copy gone from the layout and deletes it.
    common::poll_for(HEAL, || {
        let log = c.log_tail(cut, 10_000);
        if log.contains("removing a component the directory no longer lists") {
            Ok(())
        } else {
            Err(format!("node {cut} has not removed its copy"))
        }
    })
    .unwrap_or_else(|e| panic!("the returning copy discarded: {e}"));
    c.verify(VOL, 1).unwrap_or_else(|e| panic!("{e}"));
    c.qemu_io(
        1,
        1,
        VOL,
        &[
            "read -P 0xa1 0 8M",
            "read -P 0x5d 8M 4M",
            "read -P 0xa1 12M 20M",
        ],
    )
    .unwrap_or_else(|e| panic!("reading back: {e}"));
}
