//! fio runs the failure tests share: a write pass with crc32c verify
//! headers, a verify-only pass, and checks of fio's JSON report.

use super::sh;
use std::process::{Child, Command, Stdio};

/// fio writing every block of `size` once in random order with crc32c
/// verification headers, then reading everything back.
pub fn fio_write_verify(uri: &str, size: &str) -> Child {
    Command::new("fio")
        .args([
            "--name=w",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            &format!("--size={size}"),
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--output-format=json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting fio")
}

/// Same job, verification only: every block must still carry what the
/// write pass put there.
pub fn fio_verify_only(uri: &str, size: &str) {
    let out = sh(&format!(
        "fio --name=w --ioengine=nbd --uri={uri} --rw=randwrite --bs=4k --iodepth=16 \
         --size={size} --verify=crc32c --verify_only --verify_fatal=1 --verify_state_save=0 --output-format=json"
    ));
    assert_fio_clean(&out, false);
}

pub fn assert_fio_clean(json: &str, expect_writes: bool) {
    let start = json.find('{').expect("fio printed JSON");
    let v: serde_json::Value = serde_json::from_str(&json[start..]).expect("fio JSON");
    let job = &v["jobs"][0];
    assert_eq!(job["error"], 0, "fio reported an error: {json}");
    if expect_writes {
        assert!(
            job["write"]["total_ios"].as_u64().unwrap_or(0) > 0,
            "no writes: {json}"
        );
    }
    assert!(
        job["read"]["total_ios"].as_u64().unwrap_or(0) > 0,
        "no verify reads: {json}"
    );
}

pub fn finish(child: Child) {
    let out = child.wait_with_output().expect("fio");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio failed: {}\n{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_fio_clean(&stdout, true);
}
