//! Interop with real NBD clients (libnbd's nbdinfo/nbdcopy, qemu-io).
//! Each check is skipped, with a printed reason, when its binary is missing.

mod common;

use std::path::Path;
use std::process::Output;

use common::*;
use shoal_nbd::mem::MemExports;
use tokio::process::Command;

fn on_path(bin: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false)
}

async fn run(bin: &str, args: &[&str]) -> Output {
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        Command::new(bin).args(args).kill_on_drop(true).output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{bin} {args:?} timed out"))
    .unwrap_or_else(|e| panic!("{bin} failed to start: {e}"));
    if !out.status.success() {
        panic!(
            "{bin} {args:?} failed: {}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

fn skip(bin: &str) -> bool {
    if on_path(bin) {
        false
    } else {
        println!("skipping {bin} interop check: {bin} not found on PATH");
        true
    }
}

async fn interop_server() -> Server {
    let mut ex = MemExports::new();
    ex.add("name", 64 * MIB);
    ex.add("copy", 8 * MIB);
    start(ex).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdinfo_list_and_size() {
    if skip("nbdinfo") {
        return;
    }
    let srv = interop_server().await;
    let base = format!("nbd://127.0.0.1:{}", srv.addr.port());
    let out = run("nbdinfo", &["--list", &base]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("name") && text.contains("copy"), "{text}");

    let uri = format!("{base}/name");
    let out = run("nbdinfo", &["--size", &uri]).await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        (64 * MIB).to_string()
    );
    let out = run("nbdinfo", &[&uri]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&(64 * MIB).to_string()), "{text}");
    assert!(text.contains("can_multi_conn: true"), "{text}");
    wait_open_handles(&srv, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_io_write_read_pattern() {
    if skip("qemu-io") {
        return;
    }
    let srv = interop_server().await;
    let uri = format!("nbd://127.0.0.1:{}/name", srv.addr.port());
    let out = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0xab 0 1M",
            "-c",
            "read -P 0xab 0 1M",
            "-c",
            "write -z 2M 1M",
            "-c",
            "discard 4M 64k",
            "-c",
            "flush",
            "-c",
            "read -P 0 2M 1M",
            &uri,
        ],
    )
    .await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("failed"), "{text}");
    assert!(!text.contains("Pattern verification"), "{text}");
    let snap = srv.exports.disk("name").unwrap().snapshot();
    assert!(snap[..MIB].iter().all(|&b| b == 0xab));
    assert!(snap[MIB..2 * MIB].iter().all(|&b| b == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbdcopy_roundtrip() {
    if skip("nbdcopy") {
        return;
    }
    let srv = interop_server().await;
    let uri = format!("nbd://127.0.0.1:{}/copy", srv.addr.port());
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let dst = dir.path().join("dst.bin");
    let mut data = vec![0u8; 8 * MIB];
    // Random data with some all-zero stretches (exercises zero detection).
    rand::Rng::fill(&mut rand::thread_rng(), &mut data[..]);
    data[MIB..2 * MIB].fill(0);
    std::fs::write(&src, &data).unwrap();

    run("nbdcopy", &[path(&src), &uri]).await;
    assert!(srv.exports.disk("copy").unwrap().snapshot() == data);
    // nbdcopy wants an existing destination file of the right size.
    std::fs::File::create(&dst)
        .unwrap()
        .set_len(data.len() as u64)
        .unwrap();
    run("nbdcopy", &[&uri, path(&dst)]).await;
    assert!(std::fs::read(&dst).unwrap() == data);
    wait_open_handles(&srv, 0).await;
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}
