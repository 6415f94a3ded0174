//! NBD over TLS through a real cluster with real clients: with
//! `--nbd-tls require`, nbdinfo, qemu-img and qemu-io reach a volume over
//! `nbds://` with the credentials `shoal up` wrote (or `shoal cert client`
//! made), or with a pre-shared key (`--nbd-tls-psk`), and plain NBD over
//! TCP gets nothing.

mod common;

use common::{run, Cluster};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn nbds(c: &Cluster, node: u32, volume: &str, creds: &Path) -> String {
    format!(
        "nbds://{}/{volume}?tls-certificates={}",
        c.nbd_addr(node),
        creds.display()
    )
}

/// qemu's options for a TLS connection to `volume` on `node`.
/// Node `n` serves plain NBD over TCP to no one and lists nothing to it.
fn refuses_plain(c: &Cluster, n: u32) {
    let out = run(Command::new("nbdinfo").arg(c.uri(n, "v")));
    assert!(!out.status.success(), "plain NBD served by node {n}");
    let out = run(Command::new("nbdinfo").args(["--list", &format!("nbd://{}", c.nbd_addr(n))]));
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("\"v\""),
        "node {n} listed a volume to a plain client"
    );
}

/// nbdinfo reads the size of the export at `url`: it is served. The size
/// nbdinfo printed.
fn served(url: &str) -> String {
    let out = run(Command::new("nbdinfo").args(["--size", url]));
    assert!(
        out.status.success(),
        "{url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

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
        refuses_plain(&c, n);
    }

    // nbdinfo over TLS: the size.
    assert_eq!(served(&nbds(&c, 2, "v", &creds)), (64u64 << 20).to_string());

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
    served(&nbds(&c, 1, "v", &mine));
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

    // A revoked client is refused on every node from then on; the others
    // are still served.
    c.shoal(&["cert", "revoke-client", "backup-host"]);
    for n in 1..=2 {
        let url = nbds(&c, n, "v", &mine);
        common::wait_for(
            "the revocation to reach every node",
            Duration::from_secs(10),
            || {
                let out = run(Command::new("nbdinfo").args(["--size", &url]));
                match out.status.success() {
                    true => Err("still served".to_string()),
                    false => Ok(()),
                }
            },
        );
    }
    served(&nbds(&c, 2, "v", &creds));
    let err = c.shoal_fails(&["cert", "revoke-client", "nobody"]);
    assert!(err.contains("no certificate was issued"), "{err}");
    c.verify_copies("v");
}

#[test]
fn a_loopback_cluster_serves_plain_and_tls_by_default() {
    common::require("nbdinfo");
    let c = Cluster::start(1);
    c.create_volume("v", "16M", "ftt=0");
    served(&c.uri(1, "v"));
    let creds = c.data.join("tls/client");
    served(&nbds(&c, 1, "v", &creds));
    // A layout flag of a new cluster is refused on an existing one.
    let e = c.shoal_fails(&["up", "--nbd-tls", "require"]);
    assert!(e.contains("--nbd-tls"), "{e}");
}

/// A key file as GnuTLS's psktool makes it (mode 0600), for `user`, in
/// `dir`.
fn psk_file(dir: &Path, name: &str, user: &str) -> std::path::PathBuf {
    let file = dir.join(name);
    common::ok(Command::new("psktool").args(["-u", user, "-p", file.to_str().unwrap()]));
    file
}

fn nbds_psk(c: &Cluster, node: u32, volume: &str, user: &str, keys: &Path) -> String {
    format!(
        "nbds://{user}@{}/{volume}?tls-psk-file={}",
        c.nbd_addr(node),
        keys.display()
    )
}

#[test]
fn tls_psk_required_serves_key_holders_and_refuses_plain_nbd() {
    common::require("psktool");
    common::require("nbdinfo");
    common::require("qemu-io");
    let tmp = tempfile::tempdir().unwrap();
    let keys = psk_file(tmp.path(), "keys.psk", "alice");
    let c = Cluster::start_with(
        2,
        &[
            "--nbd-tls",
            "require",
            "--nbd-tls-psk",
            keys.to_str().unwrap(),
        ],
    );
    c.create_volume("v", "64M", "ftt=0");

    for n in 1..=2 {
        // With the key, on every node: the size.
        let out =
            run(Command::new("nbdinfo").args(["--size", &nbds_psk(&c, n, "v", "alice", &keys)]));
        assert!(
            out.status.success(),
            "node {n}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            (64u64 << 20).to_string()
        );
        // Plain NBD over TCP: refused, nothing listed.
        refuses_plain(&c, n);
    }

    // qemu with tls-creds-psk (DIR/keys.psk) writes and reads back.
    let (host, port) = c
        .nbd_addr(1)
        .rsplit_once(':')
        .map(|(h, p)| (h.to_string(), p.to_string()))
        .unwrap();
    let out = run(Command::new("qemu-io").args([
        "--object",
        &format!(
            "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
            tmp.path().display()
        ),
        "--image-opts",
        "-c",
        "write -P 0x6c 0 1M",
        "-c",
        "read -P 0x6c 0 1M",
        &format!(
            "driver=nbd,server.type=inet,server.host={host},server.port={port},export=v,tls-creds=tls0"
        ),
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("fail"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Another key for the same identity, and a certificate of the
    // cluster instead of a key: refused.
    let other = psk_file(tmp.path(), "other.psk", "alice");
    let out = run(Command::new("nbdinfo").args(["--size", &nbds_psk(&c, 2, "v", "alice", &other)]));
    assert!(!out.status.success(), "a wrong key was served");
    let out = run(
        Command::new("nbdinfo").args(["--size", &nbds(&c, 2, "v", &c.data.join("tls/client"))])
    );
    assert!(
        !out.status.success(),
        "a certificate was served by a PSK node"
    );
    let log = |n: u32| std::fs::read_to_string(c.node_dir(n).join("node.log")).unwrap();
    assert!(
        log(1).contains("PSK identity \"alice\""),
        "node 1 logged no upgrade with its identity"
    );
    assert!(
        log(2).contains("TLS-PSK identity \"alice\" (wrong key?)"),
        "node 2 logged no refusal of the wrong key"
    );

    // The key file is kept for the cluster's restarts, and is a flag of a
    // new cluster only.
    let layout = std::fs::read_to_string(c.data.join("cluster.json")).unwrap();
    assert!(layout.contains("keys.psk"), "{layout}");
    let e = c.shoal_fails(&["up", "--nbd-tls-psk", keys.to_str().unwrap()]);
    assert!(e.contains("--nbd-tls-psk"), "{e}");
}

/// `shoal up` refuses a key file others may read, a malformed one, and
/// one with `--nbd-tls off`, before it starts any node.
#[test]
fn bad_psk_key_files_are_refused_before_a_node_starts() {
    common::require("psktool");
    let tmp = tempfile::tempdir().unwrap();
    let subnet = common::Subnet::claim();
    let keys = psk_file(tmp.path(), "keys.psk", "alice");
    let bad = tmp.path().join("bad.psk");
    std::fs::write(&bad, "alice:00112233\n").unwrap();
    std::fs::set_permissions(&bad, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let open = tmp.path().join("open.psk");
    std::fs::copy(&keys, &open).unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    for (i, (file, extra, says)) in [
        (&open, None, "chmod 600"),
        (&bad, None, "line 1"),
        (&keys, Some("off"), "--nbd-tls off"),
    ]
    .into_iter()
    .enumerate()
    {
        let data = tmp.path().join(format!("data{i}"));
        let mut cmd = Command::new(common::shoal_bin());
        cmd.env_remove("SHOAL_API").args([
            "up",
            "--data",
            data.to_str().unwrap(),
            "--nodes",
            "1",
            "--net",
            &subnet.net(),
            "--no-demo",
            "--nbd-tls-psk",
            file.to_str().unwrap(),
        ]);
        if let Some(m) = extra {
            cmd.args(["--nbd-tls", m]);
        }
        let out = run(&mut cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{file:?} {extra:?} was taken");
        assert!(stderr.contains(says), "{file:?}: {stderr}");
        assert!(!data.join("cluster.json").exists(), "a cluster was made");
    }
}
