//! A volume's policy changed in place on real node processes (`shoal
//! volume set-policy`): up from raid1 ftt=1 to ftt=2, back down, to ftt=0
//! and back up, while a client writes; after each change the layout is
//! the new policy's on distinct nodes, the copies agree and no
//! acknowledged write is lost. Then up and down again under fio verify. Changes the cluster cannot make, policies
//! that are not policies and callers that may not are refused, and change
//! nothing.

mod common;

use common::fio::{finish, fio_verify_only, fio_write_verify};
use common::ledger::Writer;
use common::{components_of, curl, wait_for, Cluster};
use std::collections::BTreeSet;
use std::time::Duration;

/// Time allowed for a change (a copy of at most the written 64 MiB) and
/// what follows it, on a slow, shared machine.
const CHANGE: Duration = Duration::from_secs(300);
/// 4 KiB blocks the writer spreads its writes over (64 MiB of the 128).
const BLOCKS: usize = (64 << 20) / 4096;

/// Data copies, witnesses and the nodes of a `volume show` JSON, once it
/// is healthy, under policy `ftt`, with no change in progress.
fn settled(v: &serde_json::Value, ftt: u64) -> Result<(usize, usize, BTreeSet<u64>), String> {
    let comps = v["volume"]["components"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let data = comps.iter().filter(|x| x["role"] == "Data").count();
    let nodes: BTreeSet<u64> = comps.iter().filter_map(|x| x["node"].as_u64()).collect();
    let ok = v["health"] == "Healthy"
        && v["volume"]["reconfig"].is_null()
        && v["volume"]["policy"]["ftt"] == ftt;
    if ok {
        Ok((data, comps.len() - data, nodes))
    } else {
        Err(format!(
            "{} ftt={} reconfig={}: {}",
            v["health"],
            v["volume"]["policy"]["ftt"],
            v["volume"]["reconfig"],
            components_of(v)
        ))
    }
}

#[test]
fn policies_change_up_down_to_ftt0_and_back_under_writes() {
    common::require("curl");
    let c = Cluster::start(5);
    c.create_volume("v", "128M", "raid1 ftt=1");
    refusals(&c);

    let mut versions = vec![0u32; BLOCKS];
    for (policy, verb, ftt, copies, witnesses) in [
        ("raid1 ftt=2", "add", 2, 3, 2),
        ("raid1 ftt=1", "drop", 1, 2, 1),
        ("ftt=0", "drop", 0, 1, 0),
        ("raid1 ftt=1", "add", 1, 2, 1),
    ] {
        let w = Writer::start(&c.nbd_addr(1), "v", versions, 8);
        w.wait_more("writes before the change", 1_000, CHANGE);
        let out = c.shoal(&[
            "volume",
            "set-policy",
            "v",
            "--policy",
            policy,
            "--wait",
            "--timeout",
            "5m",
        ]);
        eprintln!("shoal volume set-policy v --policy {policy:?} --wait:\n{out}");
        assert!(out.contains(&format!("  {verb} ")), "{policy}: {out}");
        let done = format!(
            "committed: volume v is {}: {copies} data cop",
            policy.replace("ftt=0", "raid1 ftt=0")
        );
        assert!(out.contains(&done), "{policy}: {out}");
        // Writes go on after the commit, on the new layout.
        w.wait_more("writes after the change", 300, CHANGE);
        let ledger = w.stop(CHANGE);
        assert_eq!(ledger.errors(), 0, "writes failed during {policy}");
        let (data, wit, nodes) = wait_for(&format!("volume v settled at {policy}"), CHANGE, || {
            settled(&c.try_json(&["volume", "show", "v"])?, ftt)
        });
        assert_eq!((data, wit), (copies, witnesses), "{policy}");
        assert_eq!(nodes.len(), copies + witnesses, "distinct nodes: {nodes:?}");
        // Every acknowledged write is there, read through two nodes, and
        // the copies agree block for block.
        versions = ledger.check(&c.nbd_addr(1), "v");
        let other = ledger.check(&c.nbd_addr(5), "v");
        assert!(versions == other, "two nodes read different versions");
        c.verify_copies("v");
    }
    let logs: String = (1..=5)
        .map(|n| std::fs::read_to_string(c.node_dir(n).join("node.log")).unwrap_or_default())
        .collect();
    let commits = logs.matches("reconfiguration committed").count();
    assert!(
        commits >= 4,
        "{commits} committed reconfigurations in the logs"
    );
    both_ways_under_fio_verify(&c);
}

/// Up and back down while fio writes every block of another volume with
/// verification headers and reads them back (started before the change,
/// so its writes run through the copy), then verifies them all again
/// through another node.
fn both_ways_under_fio_verify(c: &Cluster) {
    common::require("fio");
    c.create_volume("f", "32M", "raid1 ftt=1");
    for (policy, ftt) in [("raid1 ftt=2", 2), ("raid1 ftt=1", 1)] {
        let fio = fio_write_verify(&c.uri(1, "f"), "32M");
        let out = c.shoal(&[
            "volume",
            "set-policy",
            "f",
            "--policy",
            policy,
            "--wait",
            "--timeout",
            "5m",
        ]);
        assert!(out.contains("committed: volume f"), "{policy}: {out}");
        finish(fio);
        wait_for(&format!("volume f settled at {policy}"), CHANGE, || {
            settled(&c.try_json(&["volume", "show", "f"])?, ftt)
        });
        fio_verify_only(&c.uri(5, "f"), "32M");
        c.verify_copies("f");
    }
}

/// Changes the cluster cannot make, texts that are not policies and a
/// caller that may not: each refused with why, and the volume unchanged.
fn refusals(c: &Cluster) {
    let e = c.shoal_fails(&["volume", "set-policy", "v", "--policy", "raid1 ftt=3"]);
    assert!(
        e.contains("raid1 ftt=3 needs 7 fault domains; the cluster has 5"),
        "{e}"
    );
    for (text, want) in [
        ("raid1 ftt=2 fast=yes", "unknown policy word \"fast=yes\""),
        // Three steps (raid1 ftt=2, then raid6): refused before the
        // first, since the last does not fit.
        (
            "raid6 ftt=2",
            "raid6 ftt=2 needs 6 fault domains; the cluster has 5",
        ),
        ("raid1 reserve=50", "add ftt=N"),
    ] {
        let e = c.shoal_fails(&["volume", "set-policy", "v", "--policy", text]);
        assert!(e.contains(want), "{text}: {e}");
    }
    let e = c.shoal_fails(&["volume", "set-policy", "w", "--policy", "ftt=2"]);
    assert!(e.contains("no volume named \"w\""), "{e}");
    // The API itself refuses the same, with its status.
    let url = format!("{}/v1/volumes/v/policy", c.api(2));
    let admin = format!("Authorization: Bearer {}", c.token());
    let post = |body: &str, auth: &str| {
        curl(
            &url,
            &[
                "-X",
                "POST",
                "-H",
                "content-type: application/json",
                "-H",
                auth,
                "-d",
                body,
            ],
        )
    };
    let (code, body) = post(r#"{"policy":"raid1 ftt=2 fast=yes"}"#, &admin);
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("unknown policy word"), "{body}");
    let (code, body) = post(r#"{"policy":"raid1 ftt=3"}"#, &admin);
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("fault domains"), "{body}");
    // A read-only token may look, not change.
    let ro = c.shoal(&["token", "create", "--role", "read-only"]);
    let ro = ro.trim();
    let (code, body) = post(
        r#"{"policy":"raid1 ftt=2"}"#,
        &format!("Authorization: Bearer {ro}"),
    );
    assert_eq!(code, 403, "{body}");
    let out = common::run(c.cmd().env("SHOAL_TOKEN", ro).args([
        "volume",
        "set-policy",
        "v",
        "--policy",
        "raid1 ftt=2",
    ]));
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("read-only role"), "{e}");
    // The same policy: nothing to change.
    let out = c.shoal(&["volume", "set-policy", "v", "--policy", "raid1 ftt=1"]);
    assert!(out.contains("nothing to change"), "{out}");
    let v = c.json(&["volume", "show", "v"]);
    assert!(v["volume"]["reconfig"].is_null(), "{v}");
    assert_eq!(v["volume"]["policy"]["ftt"], 1, "{v}");
    assert_eq!(v["volume"]["components"].as_array().map(Vec::len), Some(3));
}

/// The owner is killed -9 while it copies into the copy a policy change
/// added: another node takes the change over from the directory and
/// commits it, or aborts it if the dead node held an added component, and
/// then the volume's caretaker begins the wanted change again on the
/// nodes left; either way the volume ends at the new policy, healthy, with
/// no acknowledged write lost, without anyone asking again.
#[test]
fn an_owner_killed_mid_policy_change_leaves_the_change_to_the_next_owner() {
    let c = Cluster::start(6);
    c.shoal(&["cluster", "set", "resync-mib-per-s", "8"]);
    c.create_volume("v", "128M", "raid1 ftt=1");
    let v = c.json(&["volume", "show", "v"]);
    let held: BTreeSet<u64> = v["volume"]["components"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|x| x["node"].as_u64())
        .collect();
    let mut free = (1..=6u32).filter(|n| !held.contains(&u64::from(*n)));
    let owner = free.next().expect("a node holding nothing");
    let keeper = *held.iter().next().expect("a data node") as u32;
    // The owner holds nothing of the volume; the client writes through a
    // node of the volume, which forwards to the owner.
    common::sh(&format!(
        "qemu-io -f raw -c 'write -P 7 0 4k' {}",
        c.uri(owner, "v")
    ));
    let w = Writer::start(&c.nbd_addr(keeper), "v", vec![0; BLOCKS], 8);
    w.wait_more("writes before the change", 2_000, CHANGE);
    c.shoal(&["volume", "set-policy", "v", "--policy", "raid1 ftt=2"]);
    // The owner copying into the added copy.
    c.wait_log(
        owner,
        &["resync copying", "following a reconfiguration"],
        CHANGE,
    );
    c.signal(owner, "KILL");
    let ftt = wait_for("the change ended by the next owner", CHANGE, || {
        let v = c.try_json(&["volume", "show", "v"])?;
        let ftt = v["volume"]["policy"]["ftt"].as_u64().unwrap_or(9);
        let (data, wit, nodes) = settled(&v, ftt)?;
        let on_dead = nodes.contains(&u64::from(owner));
        match (ftt, data, wit) {
            (1, 2, 1) | (2, 3, 2) if !on_dead => Ok(ftt),
            _ => Err(components_of(&v)),
        }
    });
    eprintln!("after the owner's death the change ended at ftt={ftt}");
    let adopted = (1..=6).filter(|&n| n != owner).any(|n| {
        std::fs::read_to_string(c.node_dir(n).join("node.log"))
            .unwrap_or_default()
            .contains("following a reconfiguration")
    });
    assert!(adopted, "no other node followed the change");
    if ftt == 1 {
        // Aborted (an added component was on the dead node): still
        // wanted, and begun again by the caretaker.
        let v = c.json(&["volume", "show", "v"]);
        let wanted = &v["volume"]["wanted_policy"];
        assert!(
            wanted["ftt"] == 2 || v["volume"]["policy"]["ftt"] == 2,
            "the aborted change is no longer wanted: {v}"
        );
        c.wait_log_any(&["wanted policy change begun again"], CHANGE);
    }
    w.wait_more("writes after the change", 300, CHANGE);
    let ledger = w.stop(CHANGE);
    assert_eq!(ledger.errors(), 0, "writes failed");
    wait_for("volume v settled at ftt=2", CHANGE, || {
        settled(&c.try_json(&["volume", "show", "v"])?, 2)
    });
    ledger.check(&c.nbd_addr(keeper), "v");
    c.verify_copies("v");
}
