//! A failed or retired disk is replaced without restarting its node, on
//! real node processes while a client writes: `shoal device add` opens a
//! new device on a running node (through another node's API), `shoal
//! device remove` moves every component off the old one (here onto the
//! new device of the same host: three hosts leave no other fault domain)
//! and it leaves the cluster. No acknowledged write is lost, the copies
//! are identical, and a restart of the node opens the new device and not
//! the removed one. Bad requests change nothing: a relative path, an
//! unknown node or device, a path in the node's data folder, a file
//! holding data, a node's last device.

mod common;

use common::ledger::Writer;
use common::{components_of, curl, run, wait_for, Cluster};
use std::time::Duration;

/// Time allowed for a move (a copy of what was written) on a slow machine.
const MOVE: Duration = Duration::from_secs(180);
/// 4 KiB blocks the writer spreads its writes over (32 MiB).
const BLOCKS: usize = (32 << 20) / 4096;

/// Waits for `more` acknowledged writes past what `w` has now.
fn more_writes(w: &Writer, more: u64) {
    let from = w.ledger().acks();
    wait_for("writes going on", MOVE, || match w.ledger().acks() {
        n if n >= from + more => Ok(()),
        n => Err(format!("{} acknowledged since", n - from)),
    });
}

/// The ids of node `node`'s devices in `shoal status`.
fn devices_of(c: &Cluster, node: u32) -> Vec<u64> {
    let st = c.json(&["status"]);
    st["devices"]
        .as_array()
        .expect("devices")
        .iter()
        .filter(|d| d["node"] == node)
        .map(|d| d["id"].as_u64().expect("id"))
        .collect()
}

/// (node, device) of each data copy of `vol`.
fn copies(c: &Cluster, vol: &str) -> Vec<(u32, u64)> {
    let v = c.json(&["volume", "show", vol]);
    v["volume"]["components"]
        .as_array()
        .expect("components")
        .iter()
        .filter(|x| x["role"] == "Data")
        .map(|x| {
            (
                x["node"].as_u64().expect("node") as u32,
                x["device"].as_u64().expect("device"),
            )
        })
        .collect()
}

#[test]
fn a_device_is_replaced_on_a_running_node_under_writes() {
    let c = Cluster::start_sized(3, "1G", &[]);
    c.create_volume("mirror", "64M", "raid1 ftt=1");
    let w = Writer::start(&c.nbd_addr(1), "mirror", vec![0; BLOCKS], 8);
    more_writes(&w, 500);
    // A copy outside node 1 (the CLI's node): its add is handed over.
    let (t, old) = copies(&c, "mirror")
        .into_iter()
        .find(|(n, _)| *n != 1)
        .expect("a copy outside node 1");
    let (tn, oldn) = (t.to_string(), old.to_string());
    assert_eq!(devices_of(&c, t), vec![old]);

    // Refused, changing nothing.
    let err = c.shoal_fails(&["device", "remove", &oldn]);
    assert!(
        err.contains("last device node") && err.contains("nothing changed"),
        "{err}"
    );
    let err = c.shoal_fails(&["device", "add", &tn, "relative.dev", "--size", "1G"]);
    assert!(err.contains("absolute"), "{err}");
    let err = c.shoal_fails(&["device", "add", "9", "/tmp/x.dev", "--size", "1G"]);
    assert!(err.contains("no node with id 9"), "{err}");
    let err = c.shoal_fails(&["device", "remove", "999"]);
    assert!(err.contains("no device with id 999"), "{err}");
    // Disks of the host, beside (not in) the node's data folder.
    let disks = c.data.parent().expect("a parent").join(format!("disks{t}"));
    std::fs::create_dir_all(&disks).expect("mkdir");
    let inside = c.node_dir(t).join("x.dev").display().to_string();
    let err = c.shoal_fails(&["device", "add", &tn, &inside, "--size", "1G"]);
    assert!(err.contains("data folder"), "{err}");
    let precious = disks.join("precious.img");
    std::fs::write(&precious, b"someone's data").expect("write");
    let p = precious.display().to_string();
    let err = c.shoal_fails(&["device", "add", &tn, &p]);
    assert!(err.contains("refusing to format"), "{err}");
    assert_eq!(std::fs::read(&precious).expect("read"), b"someone's data");
    // No token, no add, removal or look; the member route is not served
    // to a plain caller.
    let body = format!(
        r#"{{"node":{t},"path":"{}/x.dev","size_bytes":1073741824}}"#,
        disks.display()
    );
    let json = ["-H", "Content-Type: application/json", "-d", body.as_str()];
    let (code, _) = curl(&format!("{}/v1/devices", c.api(1)), &json);
    assert_eq!(code, 401, "add without a token");
    let (code, _) = curl(&format!("{}/v1/devices/{old}", c.api(1)), &["-X", "DELETE"]);
    assert_eq!(code, 401, "remove without a token");
    let (code, _) = curl(&format!("{}/v1/devices/{old}", c.api(1)), &[]);
    assert_eq!(code, 401, "look without a token");
    let keep = format!("{}/v1/devices/{old}/keep", c.api(1));
    let (code, _) = curl(&keep, &["-X", "POST"]);
    assert_eq!(code, 401, "keep without a token");
    // A read-only token looks, and changes nothing.
    let ro = c.shoal(&[
        "token",
        "create",
        "--role",
        "read-only",
        "--note",
        "devices",
    ]);
    let ro = format!("Authorization: Bearer {}", ro.trim());
    let (code, _) = curl(&keep, &["-X", "POST", "-H", ro.as_str()]);
    assert_eq!(code, 403, "keep with a read-only token");
    let (code, _) = curl(
        &format!("{}/v1/devices/{old}", c.api(1)),
        &["-H", ro.as_str()],
    );
    assert_eq!(code, 200, "look with a read-only token");
    let (code, _) = curl(&format!("{}/v1/local/devices", c.api(t)), &json);
    assert!(
        code == 401 || code == 403 || code == 404,
        "member route: {code}"
    );
    // Nor to an admin: it is the nodes' own route.
    let auth = format!("Authorization: Bearer {}", c.token());
    let mut with_token = json.to_vec();
    with_token.extend(["-H", auth.as_str()]);
    let (code, _) = curl(&format!("{}/v1/local/devices", c.api(t)), &with_token);
    assert!(
        !(200..300).contains(&code),
        "member route to an admin: {code}"
    );
    let blocked = format!("{}/v1/local/devices/{old}/blocked", c.api(t));
    for (who, args) in [
        ("a plain caller", vec![]),
        ("an admin", vec!["-H", auth.as_str()]),
    ] {
        let (code, _) = curl(&blocked, &args);
        assert!(!(200..300).contains(&code), "member route to {who}: {code}");
    }
    assert!(
        !disks.join("x.dev").exists(),
        "a refused add created its file"
    );
    assert_eq!(devices_of(&c, t), vec![old]);

    // Add a device to node t while it runs.
    let path = disks.join("new.dev").display().to_string();
    let out = c.shoal(&["device", "add", &tn, &path, "--size", "1G"]);
    assert!(out.contains("on node") && out.contains(&path), "{out}");
    let new: u64 = out
        .trim_start_matches("device ")
        .split(':')
        .next()
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("no device id in {out:?}"));
    let mut now = devices_of(&c, t);
    now.sort_unstable();
    assert_eq!(now, vec![old, new]);
    let err = c.shoal_fails(&["device", "add", &tn, &path]);
    assert!(err.contains(&format!("already device {new}")), "{err}");

    // A removal called off while the copy is still on the old device
    // (the copy's pace held at 2 MiB/s: the 32 MiB take seconds): the
    // move already begun goes on, the device stays, empty, in service.
    c.shoal(&["cluster", "set", "resync-mib-per-s", "2"]);
    let auth = format!("Authorization: Bearer {}", c.token());
    let delete = ["-X", "DELETE", "-H", auth.as_str()];
    let (code, body) = curl(&format!("{}/v1/devices/{old}", c.api(1)), &delete);
    assert_eq!(code, 202, "removal: {body}");
    wait_for("the move off the old device begun", MOVE, || {
        let v = c.try_json(&["volume", "show", "mirror"])?;
        match v["volume"]["reconfig"].is_null() {
            false => Ok(()),
            true => Err(components_of(&v)),
        }
    });
    let out = c.shoal(&["device", "keep", &oldn]);
    assert!(out.contains("in service"), "{out}");
    wait_for("the move begun before the keep ended", MOVE, || {
        let v = c.try_json(&["volume", "show", "mirror"])?;
        match (v["volume"]["reconfig"].is_null(), copies(&c, "mirror")) {
            (true, cs) if cs.contains(&(t, new)) => Ok(()),
            _ => Err(components_of(&v)),
        }
    });
    c.shoal(&["cluster", "set", "resync-mib-per-s", "0"]);
    let out = c.shoal(&["device", "show", &oldn]);
    assert!(out.contains("in service, 0 component(s)"), "{out}");
    let mut now = devices_of(&c, t);
    now.sort_unstable();
    assert_eq!(now, vec![old, new]);

    // The two device files trade places while the node is down (disks
    // moved between slots): each store keeps its device id, known by its
    // uuid, and serves on from its new path.
    let path_of = |id: u64| -> String {
        let st = c.json(&["status"]);
        st["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .find(|d| d["id"] == id)
            .and_then(|d| d["path"].as_str())
            .map(String::from)
            .unwrap_or_else(|| panic!("no device {id} in {st}"))
    };
    let (old_path, new_path) = (path_of(old), path_of(new));
    c.signal(t, "9");
    c.wait_node(t, "down", MOVE);
    let swap = disks.join("swap.tmp");
    std::fs::rename(&old_path, &swap).expect("rename");
    std::fs::rename(&new_path, &old_path).expect("rename");
    std::fs::rename(&swap, &new_path).expect("rename");
    c.up();
    c.wait_node(t, "up", MOVE);
    assert_eq!(path_of(old), new_path, "device {old} after the swap");
    assert_eq!(path_of(new), old_path, "device {new} after the swap");
    c.wait_healthy("mirror", MOVE);
    assert!(copies(&c, "mirror").contains(&(t, new)));
    more_writes(&w, 500);

    // Remove the old one, empty now: it leaves at once. (Had it held the
    // copy, the copy would have moved onto the new device, the only place
    // left: the other hosts hold the volume's other components.)
    let out = c.shoal(&["device", "remove", &oldn]);
    assert!(out.contains(&format!("device {old} removed")), "{out}");
    assert_eq!(devices_of(&c, t), vec![new]);
    // Closed: the node holds the file no more (it was opened at the
    // node's start, since the swap: new_path is where its store is).
    let pid = std::fs::read_to_string(c.node_dir(t).join("node.pid")).expect("node.pid");
    let fds = format!("/proc/{}/fd", pid.trim());
    wait_for("the removed device's file closed", MOVE, || {
        let open: Vec<_> = std::fs::read_dir(&fds)
            .map_err(|e| e.to_string())?
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l.to_str() == Some(new_path.as_str()))
            .collect();
        match open.len() {
            0 => Ok(()),
            n => Err(format!("{n} descriptors of {new_path} open")),
        }
    });
    assert!(copies(&c, "mirror").contains(&(t, new)));
    c.wait_healthy("mirror", MOVE);
    let v = c.json(&["volume", "show", "mirror"]);
    assert!(v["volume"]["reconfig"].is_null(), "{}", components_of(&v));
    more_writes(&w, 500);

    // A restart of the node opens the new device, not the removed one
    // (its command line still names it).
    c.signal(t, "9");
    c.up();
    c.wait_node(t, "up", MOVE);
    c.wait_healthy("mirror", MOVE);
    assert_eq!(devices_of(&c, t), vec![new]);
    more_writes(&w, 500);

    let l = w.stop(MOVE);
    assert_eq!(l.errors(), 0, "writes failed");
    let a = l.check(&c.nbd_addr(1), "mirror");
    let b = l.check(&c.nbd_addr(t), "mirror");
    assert!(a == b, "two nodes read different versions");
    c.verify_copies("mirror");

    // The disk of a node that is down is still its device: another node
    // refuses it, before opening it (not a byte of it changes).
    let x = (2..=3).find(|&n| n != t).expect("a third node");
    let x_dev = c.node_dir(x).join("dev0.img").display().to_string();
    c.signal(x, "9");
    c.wait_node(x, "down", MOVE);
    let digest = |p: &str| common::sh(&format!("sha256sum {p}; stat -c '%s %b' {p}"));
    let before = digest(&x_dev);
    let err = c.shoal_fails(&["device", "add", "1", &x_dev]);
    assert!(err.contains("holds the store of device"), "{err}");
    assert_eq!(digest(&x_dev), before, "a refused add changed the disk");

    // An add the directory could not decide (no quorum: node 1 is down
    // too) is recorded on its node and carried through once the
    // directory answers, without asking again.
    c.signal(1, "9");
    let late = disks.join("late.dev").display().to_string();
    let out = run(c
        .cmd()
        .args(["device", "add", &tn, &late, "--size", "1G", "--api"])
        .arg(c.api(t)));
    assert!(
        !out.status.success(),
        "an add without a quorum went through"
    );
    c.up();
    wait_for("the recorded add served", MOVE, || {
        let st = c.try_json(&["status"])?;
        let served = st["devices"].as_array().is_some_and(|ds| {
            ds.iter()
                .any(|d| d["path"] == late.as_str() && d["node"] == t && d["state"] == "Healthy")
        });
        match served {
            true => Ok(()),
            false => Err(format!("devices: {}", st["devices"])),
        }
    });
    c.wait_healthy("mirror", MOVE);

    // An added device its node cannot open at a start is failed: nothing
    // new lands on it, and it does not count as a device the node keeps;
    // once it can be opened again, the node serves it without a restart.
    let state_of = |path: &str| -> Result<String, String> {
        let st = c.try_json(&["status"])?;
        st["devices"]
            .as_array()
            .and_then(|ds| ds.iter().find(|d| d["path"] == path))
            .and_then(|d| d["state"].as_str().map(String::from))
            .ok_or_else(|| format!("no device at {path}: {}", st["devices"]))
    };
    c.signal(t, "9");
    c.wait_node(t, "down", MOVE);
    let aside = disks.join("late.aside");
    std::fs::rename(&late, &aside).expect("rename");
    c.up();
    c.wait_node(t, "up", MOVE);
    wait_for("the unopened device failed", MOVE, || {
        match state_of(&late)? {
            s if s == "Failed" => Ok(()),
            s => Err(s),
        }
    });
    let err = c.shoal_fails(&["device", "remove", &new.to_string()]);
    assert!(err.contains("last device node"), "{err}");
    std::fs::rename(&aside, &late).expect("rename");
    wait_for("the device served again", MOVE, || match state_of(&late)? {
        s if s == "Healthy" => Ok(()),
        s => Err(s),
    });
    c.wait_healthy("mirror", MOVE);
}
