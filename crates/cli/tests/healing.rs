//! Self-healing on real node processes: a host killed -9 for good has its
//! components rebuilt on another host after the repair delay, while a
//! client writes; no acknowledged write is lost and the copies agree.

mod common;

use common::ledger::Writer;
use common::{components_of, wait_for, Cluster};
use std::time::Duration;

/// Time allowed for the cluster to notice a dead host, wait out the
/// repair delay and rebuild, on a slow machine.
const HEAL: Duration = Duration::from_secs(120);
/// The repair delay these tests set: short, so that the rebuild starts
/// within the test, and long enough to be seen waiting.
const REPAIR_DELAY: &str = "3s";
/// 4 KiB blocks the writer spreads its writes over (64 MiB).
const BLOCKS: usize = (64 << 20) / 4096;

/// The nodes of a volume's components (data and witnesses alike).
fn nodes_of(c: &Cluster, vol: &str) -> Vec<u32> {
    let v = c.json(&["volume", "show", vol]);
    v["volume"]["components"]
        .as_array()
        .expect("components")
        .iter()
        .map(|x| x["node"].as_u64().expect("node") as u32)
        .collect()
}

/// A data node of the volume other than node 1 (the owner and the
/// writer's node).
fn data_node_but_1(c: &Cluster, vol: &str) -> u32 {
    let v = c.json(&["volume", "show", vol]);
    v["volume"]["components"]
        .as_array()
        .expect("components")
        .iter()
        .filter(|x| x["role"] == "Data")
        .map(|x| x["node"].as_u64().expect("node") as u32)
        .find(|&n| n != 1)
        .expect("a data copy outside node 1")
}

#[test]
fn a_host_killed_for_good_is_rebuilt_elsewhere_under_writes() {
    let c = Cluster::start(4);
    c.shoal(&["cluster", "set", "repair-delay", REPAIR_DELAY]);
    c.create_volume("v", "128M", "raid1 ftt=1");
    let w = Writer::start(&c.nbd_addr(1), "v", vec![0; BLOCKS], 8);
    w.wait_more("writes before the kill", 2_000, HEAL);
    let victim = data_node_but_1(&c, "v");
    let before = nodes_of(&c, "v");
    c.signal(victim, "KILL");
    // The copy is absent first (the repair delay is waited out), then
    // rebuilt on the one node that held nothing of the volume.
    c.wait_component_state("v", victim, "Absent", HEAL);
    // The dead node's devices show the node's state, not their last report.
    c.wait_node(victim, "Down", HEAL);
    let status = c.json(&["status"]);
    let devices = status["devices"].as_array().cloned().unwrap_or_default();
    let of_victim: Vec<_> = devices.iter().filter(|d| d["node"] == victim).collect();
    assert!(!of_victim.is_empty(), "the dead node's devices: {status}");
    assert!(
        of_victim.iter().all(|d| d["node_state"] == "Down"),
        "the dead node's devices: {of_victim:?}"
    );
    let text = c.shoal(&["status"]);
    assert!(text.contains("node down"), "{text}");
    wait_for("the volume rebuilt away from the dead host", HEAL, || {
        let v = c.try_json(&["volume", "show", "v"])?;
        let comps = v["volume"]["components"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let on_victim = comps.iter().any(|x| x["node"] == victim);
        let all_active = comps.iter().all(|x| x["state"] == "Active");
        if !on_victim && all_active && comps.len() == before.len() {
            Ok(())
        } else {
            Err(components_of(&v))
        }
    });
    let spare = (1..=4).find(|n| !before.contains(n)).expect("a spare node");
    assert!(
        nodes_of(&c, "v").contains(&spare),
        "rebuilt on the spare node"
    );
    c.wait_healthy("v", HEAL);
    // Writes went on through the rebuild; every acknowledged one is there,
    // read through two nodes, and the two copies agree block for block.
    w.wait_more("writes after the rebuild", 500, HEAL);
    let ledger = w.stop(HEAL);
    assert_eq!(ledger.errors(), 0, "writes failed during the rebuild");
    let through1 = ledger.check(&c.nbd_addr(1), "v");
    let through_spare = ledger.check(&c.nbd_addr(spare), "v");
    assert!(
        through1 == through_spare,
        "two nodes read different versions"
    );
    c.verify_copies("v");
    let logs: String = (1..=4)
        .map(|n| std::fs::read_to_string(c.node_dir(n).join("node.log")).unwrap_or_default())
        .collect();
    assert!(
        logs.contains("reconfiguration committed"),
        "no committed reconfiguration in the logs"
    );
}

/// The nodes of a volume's data copies and witnesses.
fn roles(c: &Cluster, vol: &str) -> (Vec<u32>, Vec<u32>) {
    let v = c.json(&["volume", "show", vol]);
    let comps = v["volume"]["components"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let of = |role: &str| -> Vec<u32> {
        comps
            .iter()
            .filter(|x| x["role"] == role)
            .map(|x| x["node"].as_u64().expect("node") as u32)
            .collect()
    };
    (of("Data"), of("Witness"))
}

/// The owner of a rebuild is killed -9 while it copies into the new
/// copy (a static resync limit keeps the copy going for seconds): the
/// next owner finds the change in the directory and carries it through
/// (copying again from scratch, or aborting and rebuilding anew if the
/// new copy died with the owner), while a client writes through another
/// node; no acknowledged write is lost and the copies agree.
#[test]
fn an_owner_killed_mid_rebuild_leaves_the_change_to_the_next_owner() {
    let c = Cluster::start(5);
    c.shoal(&["cluster", "set", "repair-delay", "1s"]);
    c.shoal(&["cluster", "set", "resync-mib-per-s", "8"]);
    c.create_volume("v", "128M", "raid1 ftt=1");
    let (data, witnesses) = roles(&c, "v");
    let spares: Vec<u32> = (1..=5)
        .filter(|n| !data.contains(n) && !witnesses.contains(n))
        .collect();
    let (keeper, victim, owner) = (data[0], data[1], spares[0]);
    // The owner holds nothing of the volume; the client writes through
    // the node of the copy that survives everything.
    common::sh(&format!(
        "qemu-io -f raw -c 'write -P 7 0 4k' {}",
        c.uri(owner, "v")
    ));
    let w = Writer::start(&c.nbd_addr(keeper), "v", vec![0; BLOCKS], 8);
    w.wait_more("writes before the kill", 4_000, HEAL);
    c.signal(victim, "KILL");
    // The owner copying into the added copy.
    c.wait_log(
        owner,
        &["resync copying", "following a reconfiguration"],
        HEAL,
    );
    c.signal(owner, "KILL");
    wait_for("the volume healed on the nodes left", HEAL, || {
        let v = c.try_json(&["volume", "show", "v"])?;
        let comps = v["volume"]["components"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let dead = comps
            .iter()
            .any(|x| x["node"] == victim || x["node"] == owner);
        let all_active = comps.iter().all(|x| x["state"] == "Active");
        if !dead && all_active && comps.len() == 3 && v["volume"]["reconfig"].is_null() {
            Ok(())
        } else {
            Err(components_of(&v))
        }
    });
    w.wait_more("writes after the heal", 500, HEAL);
    let ledger = w.stop(HEAL);
    assert_eq!(ledger.errors(), 0, "writes failed");
    // A node other than the dead owner took the change over from the
    // directory (at its start, or from a view).
    let adopted = (1..=5).filter(|&n| n != owner).any(|n| {
        std::fs::read_to_string(c.node_dir(n).join("node.log"))
            .unwrap_or_default()
            .contains("following a reconfiguration")
    });
    assert!(adopted, "no later owner followed the change");
    let other = spares[1];
    let a = ledger.check(&c.nbd_addr(keeper), "v");
    let b = ledger.check(&c.nbd_addr(other), "v");
    assert!(a == b, "two nodes read different versions");
    c.verify_copies("v");
}

/// The directory's voters as `shoal status` reports them.
fn voters(c: &Cluster) -> Result<Vec<u64>, String> {
    let s = c.try_json(&["status"])?;
    let v = s["voters"].as_array().ok_or(format!("no voters in {s}"))?;
    Ok(v.iter().filter_map(|x| x.as_u64()).collect())
}

/// Six nodes: five Raft voters and a learner. A voter killed for good is
/// replaced by the learner once the repair delay has passed, so the
/// directory again tolerates two failures; it goes on deciding.
#[test]
fn a_dead_directory_voter_is_replaced_by_a_learner() {
    let c = Cluster::start(6);
    let before = wait_for("five voters", HEAL, || match voters(&c)? {
        v if v.len() == 5 => Ok(v),
        v => Err(format!("{v:?}")),
    });
    let learner = (1..=6u64).find(|n| !before.contains(n)).expect("a learner");
    c.shoal(&["cluster", "set", "repair-delay", REPAIR_DELAY]);
    let victim = *before
        .iter()
        .rev()
        .find(|&&v| v != 1)
        .expect("a voter but node 1") as u32;
    c.signal(victim, "KILL");
    let after = wait_for("the dead voter replaced", HEAL, || match voters(&c)? {
        v if v.len() == 5 && !v.contains(&u64::from(victim)) => Ok(v),
        v => Err(format!("{v:?}")),
    });
    assert!(
        after.contains(&learner),
        "{after:?}: the learner {learner} promoted"
    );
    // The directory decides with the new voters.
    c.create_volume("w", "16M", "raid1 ftt=1");
    c.wait_healthy("w", HEAL);
}
