//! Bad input gets a clear error and changes nothing. Subnets 127.0.40-49.

mod common;

use common::{require, run, shoal_bin, Cluster};
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
    let c = Cluster::start(4, 40);
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
            &[
                "volume", "create", "x", "--size", "64M", "--policy", ",",
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
        (&["volume", "set", "nosuch", "--iops", "5"], "no volume named"),
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

/// A slow fio reader that keeps an NBD connection open for `secs`.
fn hold_connection(uri: &str, secs: u32) -> std::process::Child {
    Command::new("fio")
        .args([
            "--name=hold",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randread",
            "--bs=4k",
            "--size=64M",
            &format!("--runtime={secs}"),
            "--time_based",
            "--rate_iops=50",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("fio")
}

#[test]
fn delete_with_open_connections_needs_force() {
    require("fio");
    let c = Cluster::start(3, 41);
    c.create_volume("busy", "64M", "raid1 ftt=1");
    // A client holding a connection for a while.
    let mut fio = hold_connection(&c.uri(2, "busy"), 8);
    std::thread::sleep(Duration::from_secs(2));
    let err = c.shoal_fails(&["volume", "delete", "busy"]);
    assert!(err.contains("open connections"), "{err}");
    assert!(c.json(&["volume", "show", "busy"])["volume"]["name"] == "busy");
    let _ = fio.wait();
    // Without clients the delete goes through.
    c.shoal(&["volume", "delete", "busy"]);
    c.shoal_fails(&["volume", "show", "busy"]);
    // --force deletes under a connection.
    c.create_volume("busy2", "64M", "raid1 ftt=1");
    let mut fio = hold_connection(&c.uri(1, "busy2"), 5);
    std::thread::sleep(Duration::from_secs(2));
    c.shoal(&["volume", "delete", "busy2", "--force"]);
    let _ = fio.wait();
    c.shoal_fails(&["volume", "show", "busy2"]);
}

#[test]
fn node_refuses_small_device_and_foreign_data_folder() {
    let tmp = tempfile::tempdir().expect("tmp");
    // A device file too small.
    let out = run(Command::new(shoal_bin()).args([
        "node",
        "--id",
        "1",
        "--data",
        &tmp.path().join("n").display().to_string(),
        "--device",
        &format!("{}:1M", tmp.path().join("small.img").display()),
        "--api",
        "127.0.42.1:9400",
        "--nbd",
        "127.0.42.1:10809",
        "--peer",
        "127.0.42.1:9500",
    ]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("too small"), "{err}");

    // Two clusters; a node folder of the first cannot join the second.
    let a = Cluster::start(1, 43);
    let b = Cluster::start(1, 44);
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
        "127.0.43.1:9400",
        "--nbd",
        "127.0.43.1:10809",
        "--peer",
        "127.0.43.1:9500",
        "--join",
        "127.0.44.1:9400",
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
        "127.0.44.2:9400",
        "--nbd",
        "127.0.44.2:10809",
        "--peer",
        "127.0.44.2:9500",
        "--join",
        "127.0.44.1:9400",
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
