//! Bad input gets a clear error and changes nothing.

mod common;

use common::{require, run, shoal_bin, wait_for, Cluster, Subnet};
use std::process::{Command, Stdio};
use std::time::Duration;

fn volumes(c: &Cluster) -> serde_json::Value {
    let mut v = c.json(&["volume", "list"]);
    // Health and URIs may change with liveness; compare the volumes only.
    if let Some(a) = v.as_array_mut() {
        for x in a.iter_mut() {
            *x = x["volume"].clone();
        }
    }
    v
}

#[test]
fn bad_volume_requests_are_refused_and_change_nothing() {
    let c = Cluster::start(4);
    c.create_volume("taken", "64M", "raid1 ftt=1");
    let before = volumes(&c);
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "volume", "create", "x", "--size", "64M", "--policy", "raid9",
            ],
            "unknown policy word",
        ),
        (
            &[
                "volume",
                "create",
                "x",
                "--size",
                "64M",
                "--policy",
                "raid1 ftt=7",
            ],
            "out of range",
        ),
        (
            &["volume", "create", "taken", "--size", "64M"],
            "already exists",
        ),
        (&["volume", "create", "x", "--size", "0"], "greater than 0"),
        (
            &["volume", "create", "x", "--size", "4097"],
            "not a multiple",
        ),
        (
            &["volume", "create", "x", "--size", "lots"],
            "not understood",
        ),
        (
            &["volume", "create", "bad/name", "--size", "64M"],
            "invalid",
        ),
        (
            &[
                "volume",
                "create",
                "x",
                "--size",
                "64M",
                "--policy",
                "raid1 ftt=2",
            ],
            "raid1 ftt=2 needs 5 fault domains; the cluster has 4",
        ),
        (
            &["volume", "resize", "taken", "--size", "32M"],
            "cannot shrink",
        ),
        (&["volume", "show", "nosuch"], "no volume named"),
        (&["volume", "delete", "nosuch"], "no volume named"),
        // Every policy word works or is refused: none is accepted and
        // ignored.
        (
            &[
                "volume",
                "create",
                "x",
                "--size",
                "64M",
                "--policy",
                "raid1 ftt=1 checksum=off",
            ],
            "checksum=off is not supported",
        ),
        (
            &["volume", "create", "x", "--size", "64M", "--policy", ","],
            "unknown policy word",
        ),
        (
            &[
                "volume",
                "create",
                "x",
                "--size",
                "64M",
                "--policy",
                "ftt=1 ftt=0",
            ],
            "more than once",
        ),
        (
            &[
                "volume", "create", "x", "--size", "64M", "--policy", "iops=x",
            ],
            "bad value",
        ),
        (&["volume", "set", "taken"], "nothing to set"),
        (
            &["volume", "set", "nosuch", "--iops", "5"],
            "no volume named",
        ),
    ];
    for (args, want) in cases {
        let err = c.shoal_fails(args);
        assert!(
            err.contains(want),
            "shoal {args:?}: expected {want:?} in {err:?}"
        );
        assert_eq!(volumes(&c), before, "shoal {args:?} changed the volumes");
    }
    // A good resize still works afterwards.
    c.shoal(&["volume", "resize", "taken", "--size", "128M"]);
    let v = c.json(&["volume", "show", "taken"]);
    assert_eq!(v["volume"]["size"], 128u64 << 20);
}

/// A slow fio reader that keeps an NBD connection open (for a minute at
/// most: the test ends it once it has done with it). Killed when dropped;
/// its job is a thread (`--thread`), not a child process that would keep
/// the connection after the kill.
struct Holder(std::process::Child);

impl Holder {
    fn start(uri: &str) -> Holder {
        let child = Command::new("fio")
            .args([
                "--name=hold",
                "--thread",
                "--ioengine=nbd",
                &format!("--uri={uri}"),
                "--rw=randread",
                "--bs=4k",
                "--size=64M",
                "--runtime=60",
                "--time_based",
                "--rate_iops=50",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("fio");
        Holder(child)
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// NBD connections to `volume` open on `node` (its
/// `/v1/local/connections`).
fn connections(c: &Cluster, node: u32, volume: &str) -> Result<u64, String> {
    let body = c.try_rest(node, "/v1/local/connections", &[])?;
    let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| format!("{body}: {e}"))?;
    Ok(v["volumes"][volume].as_u64().unwrap_or(0))
}

/// Waits until `volume` has (or has no) connection on `node`, seen on
/// five looks in a row: fio's nbd engine opens a first connection only to
/// learn the size and closes it before the job's own, which a single look
/// may catch.
fn wait_connections(c: &Cluster, node: u32, volume: &str, open: bool) {
    let what = if open { "open" } else { "closed" };
    let mut seen = 0;
    wait_for(
        &format!("a connection to {volume} on node {node} {what}"),
        Duration::from_secs(30),
        || match connections(c, node, volume)? {
            n if (n > 0) == open => {
                seen += 1;
                if seen >= 5 {
                    Ok(())
                } else {
                    Err(format!("{n} connections, {seen} looks in a row"))
                }
            }
            n => {
                seen = 0;
                Err(format!("{n} connections"))
            }
        },
    );
}

#[test]
fn delete_with_open_connections_needs_force() {
    require("fio");
    let c = Cluster::start(3);
    c.create_volume("busy", "64M", "raid1 ftt=1");
    // A client holding a connection.
    let fio = Holder::start(&c.uri(2, "busy"));
    wait_connections(&c, 2, "busy", true);
    let err = c.shoal_fails(&["volume", "delete", "busy"]);
    assert!(err.contains("open connections"), "{err}");
    assert!(c.json(&["volume", "show", "busy"])["volume"]["name"] == "busy");
    drop(fio);
    // Without clients (once the node saw the client go) the delete goes
    // through.
    wait_connections(&c, 2, "busy", false);
    c.shoal(&["volume", "delete", "busy"]);
    c.shoal_fails(&["volume", "show", "busy"]);
    // --force deletes under a connection.
    c.create_volume("busy2", "64M", "raid1 ftt=1");
    let fio = Holder::start(&c.uri(1, "busy2"));
    wait_connections(&c, 1, "busy2", true);
    c.shoal(&["volume", "delete", "busy2", "--force"]);
    drop(fio);
    c.shoal_fails(&["volume", "show", "busy2"]);
}

/// `shoal node` as node 1 of a cluster of its own, on `net`'s host 1.
fn lone_node(data: &std::path::Path, device: &str, net: &Subnet) -> Command {
    let mut c = Command::new(shoal_bin());
    c.args(["node", "--id", "1", "--data"])
        .arg(data)
        .args(["--device", device])
        .args(["--api", &net.api_addr(1)])
        .args(["--nbd", &net.nbd_addr(1)])
        .args(["--peer", &net.peer_addr(1)]);
    c
}

#[test]
fn node_refuses_small_device_and_foreign_data_folder() {
    let tmp = tempfile::tempdir().expect("tmp");
    // A device file too small (on addresses of a subnet of its own, in
    // case the node got as far as listening).
    let net = Subnet::claim();
    let device = format!("{}:1M", tmp.path().join("small.img").display());
    let out = run(&mut lone_node(&tmp.path().join("n"), &device, &net));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("too small"), "{err}");

    // A device file holding data that is not a device (a wiped first
    // MiB over data, as a typo on the command line would name a disk in
    // use): refused, not formatted, unchanged.
    let disk = tmp.path().join("data.img");
    let f = std::fs::File::create(&disk).expect("create");
    f.set_len(256 << 20).expect("set_len");
    std::os::unix::fs::FileExt::write_all_at(&f, b"someone's data", 8 << 20).expect("write");
    drop(f);
    let before = std::fs::read(&disk).expect("read");
    let device = format!("{}:256M", disk.display());
    let out = run(&mut lone_node(&tmp.path().join("n2"), &device, &net));
    assert!(
        !out.status.success(),
        "a node formatted a disk holding data"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refusing to format"), "{err}");
    assert!(
        std::fs::read(&disk).expect("read") == before,
        "the disk changed"
    );

    // Two clusters; a node folder of the first cannot join the second.
    let a = Cluster::start(1);
    let b = Cluster::start(1);
    a.shoal(&["down"]);
    let out = run(Command::new(shoal_bin()).args([
        "node",
        "--id",
        "1",
        "--data",
        &a.node_dir(1).display().to_string(),
        "--device",
        &format!("{}:4G", a.node_dir(1).join("dev0.img").display()),
        "--api",
        &a.api_addr(1),
        "--nbd",
        &a.nbd_addr(1),
        "--peer",
        &a.peer_addr(1),
        "--join",
        &b.api_addr(1),
    ]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("belongs to cluster"), "{err}");
    // B is untouched: still one node.
    let st = b.json(&["status"]);
    assert_eq!(st["nodes"].as_array().map(|n| n.len()), Some(1));
    // A device of cluster A given to a new node of cluster B is refused.
    let out = run(Command::new(shoal_bin()).args([
        "node",
        "--id",
        "2",
        "--data",
        &tmp.path().join("b2").display().to_string(),
        "--device",
        &format!("{}:4G", a.node_dir(1).join("dev0.img").display()),
        "--api",
        &b.api_addr(2),
        "--nbd",
        &b.nbd_addr(2),
        "--peer",
        &b.peer_addr(2),
        "--join",
        &b.api_addr(1),
    ]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("belongs to cluster"), "{err}");
    // A's folder still starts as A.
    a.up();
    assert_eq!(
        a.json(&["status"])["nodes"].as_array().map(|n| n.len()),
        Some(1)
    );
}

/// `shoal node --io-wait` out of its range (1 s to an hour) is refused by
/// the argument parser, naming the flag, before anything starts.
#[test]
fn node_refuses_an_io_wait_out_of_range() {
    let tmp = tempfile::tempdir().expect("tmp");
    let data = tmp.path().join("n");
    for (value, why) in [("0s", "at least 1s"), ("2h", "at most 3600s")] {
        let out = run(Command::new(shoal_bin()).args([
            "node",
            "--data",
            &data.display().to_string(),
            "--io-wait",
            value,
        ]));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "--io-wait {value}: {err}");
        assert!(
            err.contains("--io-wait") && err.contains(value) && err.contains(why),
            "--io-wait {value}: {err}"
        );
        assert!(!data.exists(), "--io-wait {value} made the data folder");
    }
}

/// The cluster settings: `shoal up --repair-delay` and `shoal cluster
/// set` change them; a bad value or an unknown setting is refused with a
/// clear error and changes nothing, from the command line and over REST.
#[test]
fn cluster_settings_are_set_and_bad_ones_refused() {
    require("curl");
    let c = Cluster::start_with(1, &["--repair-delay", "45s"]);
    let settings = |c: &Cluster| {
        let s = c.json(&["cluster", "settings"]);
        (s["repair_delay_s"].clone(), s["resync_mib_per_s"].clone())
    };
    assert_eq!(
        settings(&c),
        (45.into(), 0.into()),
        "shoal up --repair-delay"
    );
    let out = c.shoal(&["cluster", "set", "repair-delay", "30s"]);
    assert_eq!(
        out.trim(),
        "repair-delay: 30s\nresync-mib-per-s: 0 (adaptive)"
    );
    let out = c.shoal(&["cluster", "set", "resync-mib-per-s", "0"]);
    assert!(out.contains("resync-mib-per-s: 0 (adaptive)"), "{out}");
    let out = c.shoal(&["cluster", "set", "resync-mib-per-s", "50"]);
    assert!(out.contains("resync-mib-per-s: 50\n"), "{out}");
    assert_eq!(settings(&c), (30.into(), 50.into()));
    assert_eq!(
        c.shoal(&["cluster", "settings"]).trim(),
        "repair-delay: 30s\nresync-mib-per-s: 50"
    );
    let cases: &[(&[&str], &str)] = &[
        (&["cluster", "set", "repair-delay", "0s"], "out of range"),
        (
            &["cluster", "set", "repair-delay", "8d"],
            "out of range: 1s to 7d",
        ),
        (
            &["cluster", "set", "repair-delay", "1y"],
            "the unit is s, m, h or d",
        ),
        (
            &["cluster", "set", "repair-delay", "abc"],
            "expected a number",
        ),
        (
            &["cluster", "set", "resync-mib-per-s", "-5"],
            "resync-mib-per-s \"-5\": expected a whole number of MiB/s",
        ),
        (
            &["cluster", "set", "resync-mib-per-s", "fast"],
            "expected a whole number of MiB/s, 0 (adaptive) to 102400",
        ),
        (
            &["cluster", "set", "resync-mib-per-s", "1.5"],
            "expected a whole number",
        ),
        (
            &["cluster", "set", "resync-mib-per-s", "102401"],
            "out of range: 0 (adaptive) to 102400",
        ),
        (
            &["cluster", "set", "bogus", "1s"],
            "possible values: repair-delay, resync-mib-per-s",
        ),
    ];
    for (args, want) in cases {
        let err = c.shoal_fails(args);
        assert!(
            err.contains(want),
            "shoal {args:?}: expected {want:?} in {err:?}"
        );
        assert_eq!(
            settings(&c),
            (30.into(), 50.into()),
            "shoal {args:?} changed a setting"
        );
    }
    // The node refuses what the command line would not send, and an
    // update with one bad value changes neither setting.
    let url = format!("{}/v1/cluster/settings", c.api(1));
    let auth = format!("Authorization: Bearer {}", c.token());
    let post = |body: &str| {
        common::curl(
            &url,
            &[
                "-X",
                "POST",
                "-H",
                "content-type: application/json",
                "-H",
                &auth,
                "-d",
                body,
            ],
        )
    };
    for (body, code, want) in [
        (r#"{"repair_delay_s":0}"#, 400, "out of range"),
        (r#"{"repair_delay_s":604801}"#, 400, "out of range"),
        (r#"{"repair_delay":60}"#, 422, "unknown field"),
        (r#"{"resync_mib_per_s":102401}"#, 400, "out of range"),
        (r#"{"resync_mib_per_s":-1}"#, 422, "resync_mib_per_s"),
        (
            r#"{"repair_delay_s":60,"resync_mib_per_s":102401}"#,
            400,
            "out of range",
        ),
        (
            r#"{"repair_delay_s":0,"resync_mib_per_s":20}"#,
            400,
            "out of range",
        ),
    ] {
        let (got, text) = post(body);
        assert_eq!(got, code, "{body}: {text}");
        assert!(text.contains(want), "{body}: {text}");
        assert_eq!(
            settings(&c),
            (30.into(), 50.into()),
            "{body} changed a setting"
        );
    }
    let (got, text) = post(r#"{"repair_delay_s":60,"resync_mib_per_s":20}"#);
    assert_eq!(got, 200, "{text}");
    assert_eq!(settings(&c), (60.into(), 20.into()), "both set at once");
}
