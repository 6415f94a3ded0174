//! NBD over TLS through a real cluster with real clients: with
//! `--nbd-tls require`, nbdinfo, qemu-img and qemu-io reach a volume over
//! `nbds://` with the credentials `shoal up` wrote (or `shoal cert client`
//! made), and plain NBD over TCP gets nothing.

mod common;

use common::{run, Cluster};
use std::path::Path;
use std::process::Command;

fn nbds(c: &Cluster, node: u32, volume: &str, creds: &Path) -> String {
    format!(
        "nbds://{}/{volume}?tls-certificates={}",
        c.nbd_addr(node),
        creds.display()
    )
}

/// qemu's options for a TLS connection to `volume` on `node`.
fn qemu_tls(c: &Cluster, node: u32, volume: &str, creds: &Path) -> [String; 3] {
    let (host, port) = c
        .nbd_addr(node)
        .rsplit_once(':')
        .map(|(h, p)| (h.to_string(), p.to_string()))
        .unwrap();
    [
        "--object".into(),
        format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", creds.display()),
        format!(
            "driver=nbd,server.type=inet,server.host={host},server.port={port},export={volume},tls-creds=tls0"
        ),
    ]
}

#[test]
fn tls_required_serves_credential_holders_and_refuses_plain_nbd() {
    common::require("nbdinfo");
    common::require("qemu-io");
    common::require("qemu-img");
    let c = Cluster::start_with(3, &["--nbd-tls", "require"]);
    c.create_volume("v", "64M", "raid1 ftt=1");
    let creds = c.data.join("tls/client");
    for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        assert!(creds.join(f).exists(), "shoal up wrote no {f}");
    }

    // Plain NBD over TCP: refused on every node, nothing listed.
    for n in 1..=3 {
        let out = run(Command::new("nbdinfo").arg(c.uri(n, "v")));
        assert!(!out.status.success(), "plain NBD served by node {n}");
        let out =
            run(Command::new("nbdinfo").args(["--list", &format!("nbd://{}", c.nbd_addr(n))]));
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("\"v\""),
            "node {n} listed a volume to a plain client"
        );
    }

    // nbdinfo over TLS: the size.
    let out = run(Command::new("nbdinfo").args(["--size", &nbds(&c, 2, "v", &creds)]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        (64u64 << 20).to_string()
    );

    // qemu-io writes through node 1, qemu-img reads through node 3.
    let [o, creds1, image1] = qemu_tls(&c, 1, "v", &creds);
    let out = run(Command::new("qemu-io").args([
        &o,
        &creds1,
        "--image-opts",
        "-c",
        "write -P 0x6b 0 1M",
        "-c",
        "read -P 0x6b 0 1M",
        &image1,
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("fail"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("copy.raw");
    let [o3, creds3, image3] = qemu_tls(&c, 3, "v", &creds);
    let out = run(Command::new("qemu-img").args([
        "convert",
        &o3,
        &creds3,
        "--image-opts",
        &image3,
        "-O",
        "raw",
        copy.to_str().unwrap(),
    ]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let data = std::fs::read(&copy).unwrap();
    assert!(
        data[..1 << 20].iter().all(|&b| b == 0x6b),
        "qemu-img read other data"
    );

    // Credentials made by `shoal cert client` work too; a client folder
    // with another cluster's certificate does not.
    let mine = tmp.path().join("mine");
    c.shoal(&[
        "cert",
        "client",
        "backup-host",
        "--out",
        mine.to_str().unwrap(),
    ]);
    let out = run(Command::new("nbdinfo").args(["--size", &nbds(&c, 1, "v", &mine)]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let other = Cluster::start(1);
    let theirs = tmp.path().join("theirs");
    other.shoal(&["cert", "client", "x", "--out", theirs.to_str().unwrap()]);
    // Their certificate and key, our CA (so the client trusts the node):
    // the node refuses the certificate.
    std::fs::copy(creds.join("ca-cert.pem"), theirs.join("ca-cert.pem")).unwrap();
    let out = run(Command::new("nbdinfo").args(["--size", &nbds(&c, 1, "v", &theirs)]));
    assert!(
        !out.status.success(),
        "another cluster's client certificate was served"
    );
    c.verify_copies("v");
}

#[test]
fn a_loopback_cluster_serves_plain_and_tls_by_default() {
    common::require("nbdinfo");
    let c = Cluster::start(1);
    c.create_volume("v", "16M", "ftt=0");
    let out = run(Command::new("nbdinfo").args(["--size", &c.uri(1, "v")]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let creds = c.data.join("tls/client");
    let out = run(Command::new("nbdinfo").args(["--size", &nbds(&c, 1, "v", &creds)]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A layout flag of a new cluster is refused on an existing one.
    let e = c.shoal_fails(&["up", "--nbd-tls", "require"]);
    assert!(e.contains("--nbd-tls"), "{e}");
}
