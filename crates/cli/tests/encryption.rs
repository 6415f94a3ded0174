//! Encryption at rest (`encrypt=on`), on a cluster whose nodes also keep
//! their connections encrypted (`--encrypt-in-transit`): what clients
//! write reads back through every node, unaligned I/O works through
//! qemu's block layer (the volume advertises 512-byte sectors), trimmed
//! space reads as zeros, and no device file holds the plaintext, while
//! the same data on a volume without encryption is found there.

mod common;

use common::{run, Cluster};
use std::process::Command;

/// Plaintexts no device holds by chance: one for the encrypted volume,
/// one for the volume without encryption (the control).
const SECRET: &[u8] = b"shoal-encryption-test-secret-marker:";
const OPEN: &[u8] = b"shoal-encryption-test-open-marker:";

fn image(marker: &[u8]) -> Vec<u8> {
    marker.iter().copied().cycle().take(1 << 20).collect()
}

fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = run(c.arg(uri));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && !text.contains("fail"),
        "qemu-io {cmds:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// How many device files of the cluster contain `needle` (grep: fast on
/// whole device files).
fn devices_holding(c: &Cluster, needle: &[u8]) -> usize {
    let needle = String::from_utf8_lossy(needle).into_owned();
    (1..=c.nodes)
        .filter(|n| {
            let dev = c.node_dir(*n).join("dev0.img");
            run(Command::new("grep").args(["-qaF", &needle]).arg(&dev))
                .status
                .success()
        })
        .count()
}

#[test]
fn an_encrypted_volume_serves_plaintext_and_stores_only_ciphertext() {
    common::require("qemu-io");
    common::require("qemu-img");
    // With the connections between nodes encrypted too: the data path
    // through other nodes runs over TLS for the whole connection.
    let c = Cluster::start_sized(3, "512M", &["--encrypt-in-transit"]);
    let layout = std::fs::read_to_string(c.data.join("cluster.json")).unwrap();
    assert!(layout.contains("\"encrypt_in_transit\": true"), "{layout}");
    for n in 1..=3 {
        let args = std::fs::read(format!("/proc/{}/cmdline", c.pid(n))).unwrap();
        assert!(
            String::from_utf8_lossy(&args).contains("--encrypt-in-transit"),
            "node {n} runs without --encrypt-in-transit"
        );
    }
    c.create_volume("secret", "32M", "raid1 ftt=1 encrypt=on");
    c.create_volume("open", "32M", "raid1 ftt=1");
    let show = c.json(&["volume", "show", "secret"]);
    assert!(
        show.to_string().contains("encrypt=on") || show["volume"]["policy"]["encrypt"] == true,
        "{show}"
    );

    // Raw images of repeated markers, copied in through node 2.
    let tmp = tempfile::tempdir().unwrap();
    let block = image(SECRET);
    for (v, marker) in [("secret", SECRET), ("open", OPEN)] {
        let src = tmp.path().join(format!("{v}.raw"));
        std::fs::write(&src, image(marker)).unwrap();
        let out = run(Command::new("qemu-img").args([
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            src.to_str().unwrap(),
            &c.uri(2, v),
        ]));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // It reads back through another node, in full and unaligned.
    let back = tmp.path().join("back.raw");
    let out = run(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &c.uri(3, "secret"),
        back.to_str().unwrap(),
    ]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(&std::fs::read(&back).unwrap()[..1 << 20], &block[..]);
    qemu_io(
        &c.uri(1, "secret"),
        &["write -P 0x3c 100000 777", "read -P 0x3c 100000 777"],
    );
    // Trimmed space reads as zeros.
    qemu_io(
        &c.uri(1, "secret"),
        &["discard 2097152 65536", "read -P 0 2097152 65536"],
    );

    // The devices: the open volume's plaintext is there (the check can
    // see), the secret one's is nowhere (every write is durable before
    // its answer: nothing is left to flush).
    assert!(
        devices_holding(&c, OPEN) >= 2,
        "the unencrypted copies should hold their marker: the check cannot see"
    );
    assert_eq!(devices_holding(&c, SECRET), 0, "plaintext on a device");
    c.verify_copies("secret");
}
