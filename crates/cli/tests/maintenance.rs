//! Maintenance mode on real node processes (vSAN's three modes), while
//! clients write: a mode that would leave a volume inaccessible is refused
//! naming it; ensure-accessibility moves only what the volumes need;
//! full-data-migration empties a node, with no acknowledged write lost,
//! fio's verification clean and the copies identical; the emptied node is then removed from the
//! cluster and from the directory's voters (a node that holds anything is
//! not).

mod common;

use common::fio::{finish, fio_verify_only, fio_write_verify};
use common::ledger::Writer;
use common::{components_of, wait_for, Cluster};
use std::time::Duration;

/// Time allowed for a volume's move (a copy of what was written) on a
/// slow machine.
const MOVE: Duration = Duration::from_secs(180);
/// 4 KiB blocks each writer spreads its writes over (32 MiB).
const BLOCKS: usize = (32 << 20) / 4096;

/// The components of a volume: (id, role, node).
fn components(c: &Cluster, vol: &str) -> Vec<(u64, String, u32)> {
    let v = c.json(&["volume", "show", vol]);
    v["volume"]["components"]
        .as_array()
        .expect("components")
        .iter()
        .map(|x| {
            (
                x["id"].as_u64().expect("id"),
                x["role"].as_str().expect("role").to_string(),
                x["node"].as_u64().expect("node") as u32,
            )
        })
        .collect()
}

fn nodes_of(c: &Cluster, vol: &str) -> Vec<u32> {
    components(c, vol).into_iter().map(|(_, _, n)| n).collect()
}

/// Waits until `shoal maintenance status NODE` says ready; returns the
/// report.
fn wait_ready(c: &Cluster, node: u32) -> serde_json::Value {
    let n = node.to_string();
    wait_for(&format!("node {node} ready"), MOVE, || {
        let r = c.try_json(&["maintenance", "status", &n])?;
        if r["ready"] == true {
            Ok(r)
        } else {
            Err(r.to_string())
        }
    })
}

/// Waits for `more` acknowledged writes past what `w` has now.
fn more_writes(w: &Writer, more: u64) {
    let from = w.ledger().acks();
    wait_for("writes going on", MOVE, || match w.ledger().acks() {
        n if n >= from + more => Ok(()),
        n => Err(format!("{} acknowledged since", n - from)),
    });
}

#[test]
fn maintenance_modes_move_what_they_promise_under_writes() {
    let c = Cluster::start(5);
    c.create_volume("mirror", "64M", "raid1 ftt=1");
    c.create_volume("single", "64M", "ftt=0");
    let wm = Writer::start(&c.nbd_addr(1), "mirror", vec![0; BLOCKS], 8);
    let ws = Writer::start(&c.nbd_addr(1), "single", vec![0; BLOCKS], 8);
    more_writes(&wm, 1_000);
    more_writes(&ws, 1_000);
    let s = nodes_of(&c, "single")[0];
    let sn = s.to_string();

    // (a) Nothing moves in no-data-migration: refused, naming the ftt=0
    // volume, and the node is not in maintenance.
    let err = c.shoal_fails(&["maintenance", "enter", &sn, "--mode", "no-data-migration"]);
    assert!(
        err.contains("volume single") && err.contains("nothing changed"),
        "{err}"
    );
    assert!(
        c.json(&["maintenance", "status", &sn])["mode"].is_null(),
        "the refused mode was recorded"
    );

    // Nor is a node holding components removed (asked of that very node,
    // which hands the call to another), and bad input is refused.
    let err = c.shoal_fails(&["cluster", "remove-node", "1"]);
    assert!(
        err.contains("holds") && err.contains("full-data-migration"),
        "{err}"
    );
    let err = c.shoal_fails(&["maintenance", "enter", "9", "--mode", "full-data-migration"]);
    assert!(err.contains("no node with id 9"), "{err}");
    let err = c.shoal_fails(&["maintenance", "enter", &sn, "--mode", "full"]);
    assert!(err.contains("unknown maintenance mode"), "{err}");

    // (b) ensure-accessibility moves the ftt=0 copy only; the mirror
    // keeps every component where it was, and a new volume avoids the
    // node.
    let mirror_before = components(&c, "mirror");
    let out = c.shoal(&[
        "maintenance",
        "enter",
        &sn,
        "--mode",
        "ensure-accessibility",
    ]);
    assert!(out.contains("moving off node"), "{out}");
    let r = wait_ready(&c, s);
    assert_eq!(r["mode"], "EnsureAccessibility", "{r}");
    assert!(!nodes_of(&c, "single").contains(&s));
    assert_eq!(components(&c, "mirror"), mirror_before);
    c.create_volume("fresh", "16M", "raid1 ftt=1");
    assert!(!nodes_of(&c, "fresh").contains(&s), "placed on node {s}");
    c.wait_healthy("single", MOVE);
    more_writes(&ws, 500);

    // (d) Exit: the node leaves maintenance, nothing moves back.
    // (In the spelling, `shoal node maintenance`.)
    c.shoal(&["node", "maintenance", "exit", &sn]);
    assert!(c.json(&["maintenance", "status", &sn])["mode"].is_null());
    assert!(!nodes_of(&c, "single").contains(&s));
    let out = c.shoal(&["maintenance", "status"]);
    assert!(out.contains("no node is in maintenance"), "{out}");

    // (c) full-data-migration of a node holding a copy of the mirror (not
    // node 1, where the clients write): everything leaves it.
    let t = components(&c, "mirror")
        .into_iter()
        .find(|(_, role, n)| role == "Data" && *n != 1)
        .map(|(_, _, n)| n)
        .expect("a copy outside node 1");
    let tn = t.to_string();
    // fio writes and verifies a volume of its own through the move.
    common::require("fio");
    c.create_volume("fio", "32M", "raid1 ftt=1");
    let fio = fio_write_verify(&c.uri(1, "fio"), "32M");
    c.shoal(&["maintenance", "enter", &tn, "--mode", "full-data-migration"]);
    let r = wait_ready(&c, t);
    assert_eq!(r["components_on_node"], 0, "{r}");
    finish(fio);
    for v in ["mirror", "single", "fresh", "fio"] {
        assert!(!nodes_of(&c, v).contains(&t), "{v} still on node {t}");
        c.wait_healthy(v, MOVE);
    }
    let other = (2..=5).find(|&n| n != t).expect("another node");
    fio_verify_only(&c.uri(other, "fio"), "32M");
    c.verify_copies("fio");
    assert_eq!(components(&c, "mirror").len(), 3);
    let out = c.shoal(&["maintenance", "status", &tn]);
    assert!(out.contains("ready; holds nothing"), "{out}");
    more_writes(&wm, 500);
    more_writes(&ws, 500);
    let (lm, ls) = (wm.stop(MOVE), ws.stop(MOVE));
    assert_eq!(lm.errors() + ls.errors(), 0, "writes failed");
    for (l, v) in [(&lm, "mirror"), (&ls, "single")] {
        let a = l.check(&c.nbd_addr(1), v);
        let b = l.check(&c.nbd_addr(other), v);
        assert!(a == b, "two nodes read different versions of {v}");
        c.verify_copies(v);
    }

    // The emptied node is removed: from the directory and its voters.
    let st = c.json(&["status"]);
    let voter = st["voters"]
        .as_array()
        .expect("voters")
        .iter()
        .any(|v| v == t);
    let out = c.shoal(&["node", "remove", &tn]);
    assert!(out.contains("removed from the cluster"), "{out}");
    if voter {
        assert!(out.contains("voters"), "{out}");
    }
    wait_for("the node gone from status", MOVE, || {
        let st = c.try_json(&["status"])?;
        let listed = st["nodes"]
            .as_array()
            .is_some_and(|ns| ns.iter().any(|n| n["id"] == t));
        let voting = st["voters"]
            .as_array()
            .is_some_and(|vs| vs.iter().any(|v| v == t));
        if listed || voting {
            Err(format!("nodes {} voters {}", st["nodes"], st["voters"]))
        } else {
            Ok(())
        }
    });
    // The cluster goes on deciding without it.
    c.create_volume("after", "16M", "raid1 ftt=1");
    for v in ["mirror", "single", "after"] {
        c.wait_healthy(v, MOVE);
    }
    let v = c.json(&["volume", "show", "mirror"]);
    assert!(v["volume"]["reconfig"].is_null(), "{}", components_of(&v));
}
