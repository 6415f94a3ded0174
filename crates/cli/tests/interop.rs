//! Interoperability tests: real NBD clients (qemu-img, qemu-io, fio,
//! nbdinfo, nbdcopy, nbdfuse + ext4 on a loop device) against a real local
//! cluster of `shoal` node processes. Every test's cluster has a loopback
//! subnet of its own, so that the tests can run in parallel. Missing tools
//! are failures, not skips: CI installs them.

mod common;

use common::{ok, pid_alive, poll_for, require, run, sh, wait_for, Cluster};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const HEALTHY: Duration = Duration::from_secs(30);
const POLICY: &str = "raid1 ftt=1";
const MIB: u64 = 1024 * 1024;

/// Prints the wall time of a test when it ends (pass or fail).
struct Timed(&'static str, Instant);

impl Timed {
    fn start(name: &'static str) -> Timed {
        Timed(name, Instant::now())
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        eprintln!("[interop] {} took {:.1?}", self.0, self.1.elapsed());
    }
}

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("shoal-interop")
        .tempdir()
        .expect("tempdir")
}

fn show(out: &Output) -> String {
    format!(
        "status: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `mib` MiB from /dev/urandom into `path`.
fn random_file(path: &Path, mib: u64) {
    sh(&format!(
        "head -c {mib}M /dev/urandom > '{}'",
        path.display()
    ));
    assert_eq!(std::fs::metadata(path).unwrap().len(), mib * MIB);
}

fn start_volume(vol: &str, size: &str) -> Cluster {
    let c = Cluster::start(4);
    c.create_volume(vol, size, POLICY);
    c.wait_healthy(vol, HEALTHY);
    c
}

fn owner(c: &Cluster, vol: &str) -> Option<u64> {
    c.json(&["volume", "show", vol])["volume"]["owner"].as_u64()
}

// ---------------------------------------------------------------------------
// 1. qemu-img

#[test]
fn qemu_img_convert_and_compare() {
    let _t = Timed::start("qemu_img_convert_and_compare");
    require("qemu-img");
    require("qemu-io");
    let c = start_volume("vol", "256M");
    // Make node 1 the owner (the first I/O claims the volume), so that the
    // write through node 2 and the reads through nodes 3 and 4 are forwarded.
    ok(Command::new("qemu-io").args(["-f", "raw", "-c", "read 0 4k", &c.uri(1, "vol")]));
    assert_eq!(
        owner(&c, "vol"),
        Some(1),
        "the first I/O through node 1 should make it the owner"
    );

    let tmp = tempdir();
    let img = tmp.path().join("src.img");
    random_file(&img, 256);
    let img_s = img.to_str().unwrap();

    ok(Command::new("qemu-img").args([
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        img_s,
        &c.uri(2, "vol"),
    ]));
    let out = ok(Command::new("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        img_s,
        &c.uri(3, "vol"),
    ]));
    assert!(
        out.contains("Images are identical"),
        "qemu-img compare through node 3: {out}"
    );
    c.verify_copies("vol");

    // The comparison really reads the volume: one changed byte in the
    // local file (at 100 MiB + 7) must be reported, through node 4.
    sh(&format!(
        "printf '\\x00\\xff' | dd of='{img_s}' bs=1 seek=$((100*1024*1024 + 7)) conv=notrunc status=none"
    ));
    let out = run(Command::new("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        img_s,
        &c.uri(4, "vol"),
    ]));
    assert_eq!(
        out.status.code(),
        Some(1),
        "qemu-img compare must see the difference:\n{}",
        show(&out)
    );
    // qemu-img reports the start of the first differing sector.
    let text = String::from_utf8_lossy(&out.stdout);
    let at: Option<u64> = text
        .split("mismatch at offset ")
        .nth(1)
        .and_then(|t| t.split(|ch: char| !ch.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok());
    assert!(
        at.is_some_and(|o| (100 * MIB..=100 * MIB + 8).contains(&o)),
        "unexpected mismatch report (changed bytes at 100 MiB + 7):\n{}",
        show(&out)
    );
    assert_eq!(
        owner(&c, "vol"),
        Some(1),
        "forwarded I/O must not move ownership"
    );
}

// ---------------------------------------------------------------------------
// 2. qemu-io patterns, unaligned I/O, write-zeroes and discard

/// Runs qemu-io with the given commands on `uri` and checks that every
/// command succeeded and every pattern matched.
fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    cmd.arg(uri);
    let out = run(&mut cmd);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let lower = text.to_lowercase();
    assert!(
        out.status.success()
            && !lower.contains("error")
            && !lower.contains("failed")
            && !text.contains("Pattern verification failed"),
        "qemu-io on {uri} with {cmds:?}:\n{}",
        show(&out)
    );
    // One report line per command ("wrote"/"read"/"discard"), so a command
    // that qemu-io silently skipped is noticed too.
    let done = text
        .lines()
        .filter(|l| l.starts_with("wrote ") || l.starts_with("read ") || l.starts_with("discard "))
        .count();
    let expected = cmds.iter().filter(|c| !c.starts_with("flush")).count();
    assert_eq!(done, expected, "qemu-io did not run every command:\n{text}");
    text
}

#[test]
fn qemu_io_patterns() {
    let _t = Timed::start("qemu_io_patterns");
    require("qemu-io");
    let c = start_volume("vol", "64M");
    let u1 = c.uri(1, "vol");
    let u3 = c.uri(3, "vol");

    // Background pattern first, so that zeroed and discarded ranges held
    // data before (a fresh volume reads zeros anyway).
    qemu_io(&u1, &["write -P 0x11 0 8M", "flush"]);
    qemu_io(
        &u1,
        &[
            "write -P 0x5a 0 1M",
            // 3 bytes across the first 4 KiB boundary.
            "write -P 0xa5 4095 3",
            "read -P 0x5a 0 4095",
            "read -P 0xa5 4095 3",
            "read -P 0x5a 4098 1044478",
            "read -P 0x11 1M 1M",
            "write -z 2M 1M",
            "read -P 0 2M 1M",
            "read -P 0x11 3M 1M",
            "discard 4M 1M",
            "read -P 0 4M 1M",
            "read -P 0x11 5M 1M",
            "flush",
        ],
    );
    // Another node (forwarding to the owner) sees the same bytes, and an
    // unaligned write through it does not disturb its neighbours.
    qemu_io(
        &u3,
        &[
            "read -P 0x5a 0 4095",
            "read -P 0xa5 4095 3",
            "read -P 0x5a 4098 1044478",
            "read -P 0 2M 1M",
            "read -P 0 4M 1M",
            "write -P 0xc3 6291457 10000",
            "read -P 0x11 6291456 1",
            "read -P 0xc3 6291457 10000",
            "read -P 0x11 6301457 4079",
            "write -P 0x3c 65535 131075",
            "read -P 0x5a 65534 1",
            "read -P 0x3c 65535 131075",
            "read -P 0x5a 196610 1",
        ],
    );
    qemu_io(
        &u1,
        &[
            "read -P 0x11 6291456 1",
            "read -P 0xc3 6291457 10000",
            "read -P 0x3c 65535 131075",
            "read -P 0x11 7M 1M",
        ],
    );
    // The helper itself must notice a wrong pattern.
    let bad = run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x77 0 4k", &u3]));
    let text = String::from_utf8_lossy(&bad.stdout);
    assert!(
        text.contains("Pattern verification failed"),
        "reading a pattern that is not there must fail:\n{}",
        show(&bad)
    );
    c.verify_copies("vol");
}

// ---------------------------------------------------------------------------
// 3. fio with verification

/// Runs fio with `args` (plus JSON output and continue_on_error=all, so
/// that every error is counted in total_err instead of stopping at the
/// first one) and returns the job's JSON, or why the run is not clean.
fn try_fio(args: &[&str]) -> Result<serde_json::Value, String> {
    let mut cmd = Command::new("fio");
    cmd.args(args)
        .args(["--output-format=json", "--continue_on_error=all"]);
    let out = run(&mut cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The nbd engine prints "fio: connected to NBD server" before the JSON.
    let Some(json) = stdout
        .find('{')
        .and_then(|i| serde_json::from_str::<serde_json::Value>(&stdout[i..]).ok())
    else {
        return Err(format!("fio gave no JSON:\n{}", show(&out)));
    };
    let job = json["jobs"][0].clone();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let problem = if !out.status.success() {
        "fio failed"
    } else if job["error"] != 0 {
        "fio job error"
    } else if job["total_err"] != 0 {
        "fio counted errors (total_err)"
    } else if stderr.contains("verify:") || stderr.contains("io_u error") {
        "fio reported errors"
    } else {
        return Ok(job);
    };
    Err(format!(
        "{problem}\n{}\nfio job: {}",
        show(&out),
        serde_json::to_string_pretty(&job).unwrap()
    ))
}

fn fio(args: &[&str]) -> serde_json::Value {
    let t = Instant::now();
    let job = try_fio(args).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("[interop] fio {} took {:.1?}", args[0], t.elapsed());
    job
}

fn io_bytes(job: &serde_json::Value, dir: &str) -> u64 {
    job[dir]["io_bytes"].as_u64().unwrap_or(0)
}

#[test]
fn fio_verify() {
    let _t = Timed::start("fio_verify");
    require("fio");
    require("nbdkit");
    let c = start_volume("vol", "128M");

    // Every 4 KiB block of 64 MiB written once in random order through a
    // non-owner (node 2 forwards to node 1 after the first I/O there)...
    ok(Command::new("qemu-io").args(["-f", "raw", "-c", "read 0 4k", &c.uri(1, "vol")]));
    let uri2 = format!("--uri={}", c.uri(2, "vol"));
    let job = fio(&[
        "--name=randwrite",
        "--ioengine=nbd",
        &uri2,
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--size=64M",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
    ]);
    assert_eq!(
        io_bytes(&job, "write"),
        64 * MIB,
        "fio wrote less than asked"
    );
    assert_eq!(
        io_bytes(&job, "read"),
        64 * MIB,
        "fio verified less than it wrote"
    );

    // ... then mixed sizes, 512 B aligned (sub-block read-modify-write),
    // through the owner, in the other 64 MiB.
    let uri1 = format!("--uri={}", c.uri(1, "vol"));
    let job = fio(&[
        "--name=mixed",
        "--ioengine=nbd",
        &uri1,
        "--rw=randrw",
        "--bsrange=512-64k",
        "--iodepth=16",
        "--offset=64M",
        "--size=32M",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
    ]);
    assert!(io_bytes(&job, "write") > 0, "mixed job wrote nothing");
    assert!(io_bytes(&job, "read") > 0, "mixed job read nothing");

    // The first pass's data is still there: a verify-only pass reading
    // every block back through a third node.
    let uri3 = format!("--uri={}", c.uri(3, "vol"));
    let job = fio(&[
        "--name=randwrite",
        "--ioengine=nbd",
        &uri3,
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--size=64M",
        "--verify=crc32c",
        "--verify_only",
        "--verify_fatal=1",
    ]);
    assert_eq!(
        io_bytes(&job, "read"),
        64 * MIB,
        "verify-only pass read less than 64 MiB"
    );
    c.verify_copies("vol");

    // The checks above can fail: the same job against a sink that drops
    // writes must be rejected.
    let tmp = tempdir();
    let sock = tmp.path().join("null.sock");
    let mut nbdkit = Command::new("nbdkit")
        .args(["-f", "-U", sock.to_str().unwrap(), "null", "4M"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting nbdkit");
    wait_for("nbdkit's socket", Duration::from_secs(10), || {
        if sock.exists() {
            Ok(())
        } else {
            Err(format!("no {}", sock.display()))
        }
    });
    let uri = format!("--uri=nbd+unix:///?socket={}", sock.display());
    let bad = try_fio(&[
        "--name=null",
        "--ioengine=nbd",
        &uri,
        "--rw=randwrite",
        "--bs=4k",
        "--size=4M",
        "--verify=crc32c",
        "--do_verify=1",
    ]);
    let _ = nbdkit.kill();
    let _ = nbdkit.wait();
    let why = bad.expect_err("fio checks accepted a run against a device that drops writes");
    assert!(why.contains("error"), "unexpected rejection: {why}");
}

// ---------------------------------------------------------------------------
// 4. nbdinfo, export listing, unknown exports, I/O past the end

/// A minimal NBD client speaking the raw protocol (fixed newstyle,
/// NBD_OPT_GO, simple replies), to send requests that libnbd and qemu
/// refuse to send, such as I/O past the end of the export.
mod raw {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Duration;

    const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
    const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
    const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
    const REQUEST_MAGIC: u32 = 0x2560_9513;
    const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
    const OPT_GO: u32 = 7;
    const REP_ACK: u32 = 1;
    const REP_INFO: u32 = 3;
    pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
    pub const CMD_READ: u16 = 0;
    pub const CMD_WRITE: u16 = 1;
    pub const CMD_DISC: u16 = 2;
    pub const CMD_TRIM: u16 = 4;
    pub const CMD_WRITE_ZEROES: u16 = 6;
    pub const EINVAL: u32 = 22;
    pub const ENOSPC: u32 = 28;

    pub struct Conn {
        s: TcpStream,
        pub size: u64,
        handle: u64,
    }

    fn u16_of(s: &mut TcpStream) -> u16 {
        let mut b = [0u8; 2];
        s.read_exact(&mut b).expect("nbd read");
        u16::from_be_bytes(b)
    }
    fn u32_of(s: &mut TcpStream) -> u32 {
        let mut b = [0u8; 4];
        s.read_exact(&mut b).expect("nbd read");
        u32::from_be_bytes(b)
    }
    fn u64_of(s: &mut TcpStream) -> u64 {
        let mut b = [0u8; 8];
        s.read_exact(&mut b).expect("nbd read");
        u64::from_be_bytes(b)
    }

    impl Conn {
        /// Handshake and NBD_OPT_GO; `Err(reply type)` if the server refuses.
        pub fn open(addr: &str, name: &str) -> Result<Conn, u32> {
            let mut s = TcpStream::connect(addr).expect("connecting to the NBD port");
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            assert_eq!(u64_of(&mut s), NBDMAGIC, "greeting");
            assert_eq!(u64_of(&mut s), IHAVEOPT, "not a newstyle server");
            let _flags = u16_of(&mut s);
            // NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES
            s.write_all(&3u32.to_be_bytes()).unwrap();
            let mut opt = Vec::new();
            opt.extend_from_slice(&IHAVEOPT.to_be_bytes());
            opt.extend_from_slice(&OPT_GO.to_be_bytes());
            opt.extend_from_slice(&(4 + name.len() as u32 + 2).to_be_bytes());
            opt.extend_from_slice(&(name.len() as u32).to_be_bytes());
            opt.extend_from_slice(name.as_bytes());
            opt.extend_from_slice(&0u16.to_be_bytes());
            s.write_all(&opt).unwrap();
            let mut size = None;
            loop {
                assert_eq!(u64_of(&mut s), OPT_REPLY_MAGIC, "option reply magic");
                assert_eq!(u32_of(&mut s), OPT_GO, "reply to another option");
                let kind = u32_of(&mut s);
                let len = u32_of(&mut s) as usize;
                let mut data = vec![0u8; len];
                s.read_exact(&mut data).unwrap();
                match kind {
                    REP_ACK => break,
                    REP_INFO if len >= 12 && data[0..2] == [0, 0] => {
                        size = Some(u64::from_be_bytes(data[2..10].try_into().unwrap()));
                    }
                    REP_INFO => {}
                    k if k & 0x8000_0000 != 0 => {
                        let why = String::from_utf8_lossy(&data);
                        eprintln!("NBD_OPT_GO {name:?} at {addr}: error {k:#x}: {why}");
                        return Err(k);
                    }
                    k => panic!("unexpected option reply {k:#x}"),
                }
            }
            Ok(Conn {
                s,
                size: size.expect("no NBD_INFO_EXPORT in the reply to NBD_OPT_GO"),
                handle: 0,
            })
        }

        fn header(&mut self, cmd: u16, offset: u64, len: u32, out: &mut Vec<u8>) -> u64 {
            self.handle += 1;
            out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
            out.extend_from_slice(&0u16.to_be_bytes());
            out.extend_from_slice(&cmd.to_be_bytes());
            out.extend_from_slice(&self.handle.to_be_bytes());
            out.extend_from_slice(&offset.to_be_bytes());
            out.extend_from_slice(&len.to_be_bytes());
            self.handle
        }

        /// Reads one simple reply header: (handle, error).
        fn reply(&mut self) -> (u64, u32) {
            assert_eq!(
                u32_of(&mut self.s),
                SIMPLE_REPLY_MAGIC,
                "simple reply magic"
            );
            let error = u32_of(&mut self.s);
            (u64_of(&mut self.s), error)
        }

        /// Sends one request and returns (error, read data).
        pub fn request(
            &mut self,
            cmd: u16,
            offset: u64,
            len: u32,
            payload: &[u8],
        ) -> (u32, Vec<u8>) {
            let mut r = Vec::with_capacity(28 + payload.len());
            let handle = self.header(cmd, offset, len, &mut r);
            r.extend_from_slice(payload);
            self.s.write_all(&r).unwrap();
            let (got, error) = self.reply();
            assert_eq!(got, handle, "reply handle");
            let mut data = Vec::new();
            if error == 0 && cmd == CMD_READ {
                data.resize(len as usize, 0);
                self.s.read_exact(&mut data).unwrap();
            }
            (error, data)
        }

        /// Sends all the writes at once (pipelined), then collects the
        /// replies, in whatever order they come; returns the errors.
        pub fn write_all(&mut self, writes: &[(u64, Vec<u8>)]) -> Vec<u32> {
            let mut buf = Vec::new();
            let mut handles = std::collections::HashMap::new();
            for (i, (off, data)) in writes.iter().enumerate() {
                let h = self.header(CMD_WRITE, *off, data.len() as u32, &mut buf);
                buf.extend_from_slice(data);
                handles.insert(h, i);
            }
            self.s.write_all(&buf).unwrap();
            let mut errors = vec![u32::MAX; writes.len()];
            for _ in 0..writes.len() {
                let (h, error) = self.reply();
                let i = handles
                    .remove(&h)
                    .expect("reply to an unknown or answered handle");
                errors[i] = error;
            }
            errors
        }

        pub fn disconnect(mut self) {
            let mut r = Vec::new();
            self.header(CMD_DISC, 0, 0, &mut r);
            let _ = self.s.write_all(&r);
        }
    }
}

fn nbdinfo_json(args: &[&str]) -> serde_json::Value {
    let out = ok(Command::new("nbdinfo").arg("--json").args(args));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("nbdinfo --json {args:?}: {e}\n{out}"))
}

fn export_names(listing: &serde_json::Value) -> Vec<String> {
    listing["exports"]
        .as_array()
        .map(|xs| {
            xs.iter()
                .filter_map(|x| x["export-name"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn nbdinfo_list_and_errors() {
    let _t = Timed::start("nbdinfo_list_and_errors");
    require("nbdinfo");
    require("qemu-io");
    let c = start_volume("alpha", "256M");
    c.create_volume("beta", "64M", POLICY);
    c.wait_healthy("beta", HEALTHY);
    let server = |node: u32| format!("nbd://{}", c.nbd_addr(node));

    // Every node lists every volume.
    for node in [1, 4] {
        let names = export_names(&nbdinfo_json(&["--list", &server(node)]));
        for v in ["alpha", "beta"] {
            assert!(
                names.iter().any(|n| n == v),
                "node {node} does not list {v}: {names:?}"
            );
        }
        assert_eq!(
            names.len(),
            2,
            "node {node} lists more than the two volumes: {names:?}"
        );
    }
    let out = ok(Command::new("nbdinfo").args(["--list", &server(2)]));
    assert!(
        out.contains("export=\"alpha\"") && out.contains("export=\"beta\""),
        "nbdinfo --list (text) on node 2:\n{out}"
    );

    // An unknown export is refused with a useful message.
    let bad = run(Command::new("nbdinfo").arg(format!("{}/nosuch", server(1))));
    let err = String::from_utf8_lossy(&bad.stderr).to_lowercase();
    assert!(
        !bad.status.success(),
        "nbdinfo of an unknown export succeeded:\n{}",
        show(&bad)
    );
    assert!(
        err.contains("nosuch")
            && (err.contains("no such") || err.contains("not found") || err.contains("unknown")),
        "the error does not say the export is unknown:\n{}",
        show(&bad)
    );
    match raw::Conn::open(&c.nbd_addr(3), "nosuch") {
        Err(kind) => assert_eq!(
            kind,
            raw::REP_ERR_UNKNOWN,
            "NBD_OPT_GO of an unknown export"
        ),
        Ok(_) => panic!("NBD_OPT_GO of an unknown export succeeded"),
    }

    // Sizes, and the advertised flags.
    for (v, size, node) in [("alpha", 256 * MIB, 1), ("beta", 64 * MIB, 3)] {
        let info = nbdinfo_json(&[&c.uri(node, v)]);
        let x = &info["exports"][0];
        assert_eq!(
            x["export-size"].as_u64(),
            Some(size),
            "export-size of {v}: {info}"
        );
        assert_eq!(x["is_read_only"], false, "{v} is read-only: {info}");
        assert_eq!(
            x["can_multi_conn"], true,
            "{v} does not advertise multi-conn: {info}"
        );
    }

    // I/O past the end. qemu refuses it on the client side...
    for (node, cmd) in [
        (1, "read 256M 4k"),
        (2, "write 268431360 8k"),
        (2, "read 268435455 2"),
    ] {
        let out =
            run(Command::new("qemu-io").args(["-f", "raw", "-c", cmd, &c.uri(node, "alpha")]));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !out.status.success()
                || text.to_lowercase().contains("error")
                || text.contains("failed"),
            "qemu-io {cmd:?} past the end succeeded:\n{}",
            show(&out)
        );
    }
    // ... so the server side is checked with raw requests, through the
    // owner and through a forwarding node: errors, and the connection
    // stays usable (a rejected write's payload is skipped).
    for node in [1, 2] {
        let addr = c.nbd_addr(node);
        let mut conn = raw::Conn::open(&addr, "alpha").expect("NBD_OPT_GO alpha");
        assert_eq!(conn.size, 256 * MIB);
        let end = conn.size;
        let pattern = vec![0xe7u8; 4096];
        assert_eq!(
            conn.request(raw::CMD_WRITE, end - 4096, 4096, &pattern).0,
            0,
            "last block write"
        );
        use raw::{CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES, EINVAL, ENOSPC};
        let cases = [
            ("read at the end", CMD_READ, end, 4096, EINVAL),
            ("read across the end", CMD_READ, end - 4096, 8192, EINVAL),
            (
                "read far past the end",
                CMD_READ,
                u64::MAX - 100,
                4096,
                EINVAL,
            ),
            ("write across the end", CMD_WRITE, end - 512, 4096, ENOSPC),
            (
                "write-zeroes past the end",
                CMD_WRITE_ZEROES,
                end,
                4096,
                ENOSPC,
            ),
            ("trim past the end", CMD_TRIM, end, 4096, EINVAL),
        ];
        for (what, cmd, off, len, want) in cases {
            // A rejected write still carries its payload, which the server
            // must skip to stay in step with the stream.
            let payload = if cmd == CMD_WRITE {
                vec![0xbd; len as usize]
            } else {
                vec![]
            };
            let (err, _) = conn.request(cmd, off, len, &payload);
            assert_eq!(
                err, want,
                "{what} through node {node}: error {err}, want {want}"
            );
        }
        let (err, data) = conn.request(raw::CMD_READ, end - 4096, 4096, &[]);
        assert_eq!(
            err, 0,
            "read of the last block after the rejected requests (node {node})"
        );
        assert!(
            data == pattern,
            "the last block changed: a rejected write reached the volume (node {node})"
        );
        conn.disconnect();
    }

    // The node still serves.
    let info = nbdinfo_json(&[&c.uri(1, "alpha")]);
    assert_eq!(info["exports"][0]["export-size"].as_u64(), Some(256 * MIB));
    ok(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "read -P 0xe7 268431360 4k",
        &c.uri(2, "alpha"),
    ]));
    c.verify_copies("alpha");
}

/// The same volume through a node's Unix socket (a client on the node's
/// host) and through TCP on another node; wrong export names refused; a
/// socket file left by a node killed with -9 replaced at its restart.
#[test]
fn unix_socket_serves_local_clients() {
    let _t = Timed::start("unix_socket_serves_local_clients");
    require("nbdinfo");
    require("qemu-io");
    let c = start_volume("vol", "64M");

    let info = nbdinfo_json(&[&c.unix_uri(1, "vol")]);
    assert_eq!(
        info["exports"][0]["export-size"].as_u64(),
        Some(64 * MIB),
        "{info}"
    );
    let names = export_names(&nbdinfo_json(&[
        "--list",
        &format!(
            "nbd+unix:///?socket={}",
            c.node_dir(2).join("nbd.sock").display()
        ),
    ]));
    assert_eq!(
        names,
        vec!["vol".to_string()],
        "listing over node 2's socket"
    );
    let bad = run(Command::new("nbdinfo").arg(c.unix_uri(1, "nosuch")));
    assert!(
        !bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("nosuch"),
        "an unknown export over the socket:\n{}",
        show(&bad)
    );

    // Written over one node's socket, read over TCP elsewhere, and back.
    qemu_io(&c.unix_uri(1, "vol"), &["write -P 0x5a 1M 256k", "flush"]);
    qemu_io(
        &c.uri(3, "vol"),
        &["read -P 0x5a 1M 256k", "write -P 0xa5 8M 64k"],
    );
    qemu_io(
        &c.unix_uri(2, "vol"),
        &["read -P 0xa5 8M 64k", "read -P 0x5a 1M 256k"],
    );

    // kill -9 leaves the socket file; the restarted node replaces it.
    let sock = c.node_dir(2).join("nbd.sock");
    c.signal(2, "KILL");
    wait_gone(c.pid(2));
    assert!(sock.exists(), "the killed node's socket file is gone");
    c.up();
    c.wait_healthy("vol", HEALTHY);
    qemu_io(&c.unix_uri(2, "vol"), &["read -P 0xa5 8M 64k"]);

    // A node asked to serve a socket another node serves does not start.
    let out = run(Command::new(common::shoal_bin()).args([
        "node",
        "--id",
        "9",
        "--data",
        &c.data.join("node9").display().to_string(),
        "--peer",
        &c.peer_addr(9),
        "--nbd",
        &c.nbd_addr(9),
        "--api",
        &c.api_addr(9),
        "--nbd-socket",
        &sock.display().to_string(),
    ]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("served by another process"),
        "a second node on a live socket:\n{}",
        show(&out)
    );
    qemu_io(&c.unix_uri(2, "vol"), &["read -P 0x5a 1M 256k"]);
    c.verify_copies("vol");
}

/// Waits until process `pid` is gone (or a zombie nobody reaped yet).
fn wait_gone(pid: i32) {
    wait_for(&format!("process {pid} to end"), HEALTHY, || {
        if pid_alive(pid) {
            Err("running".into())
        } else {
            Ok(())
        }
    });
}

// ---------------------------------------------------------------------------
// 5. nbdcopy

fn cmp(a: &Path, b: &Path) {
    let out = run(Command::new("cmp").arg(a).arg(b));
    assert!(
        out.status.success(),
        "{} and {} differ:\n{}",
        a.display(),
        b.display(),
        show(&out)
    );
}

#[test]
fn nbdcopy_both_ways() {
    let _t = Timed::start("nbdcopy_both_ways");
    require("nbdcopy");
    require("nbdinfo");
    let c = start_volume("vol", "64M");
    let info = nbdinfo_json(&[&c.uri(1, "vol")]);
    assert_eq!(
        info["exports"][0]["can_multi_conn"], true,
        "multi-conn not advertised: {info}"
    );

    let tmp = tempdir();
    let p = |n: &str| -> PathBuf { tmp.path().join(n) };
    let s = |p: &PathBuf| p.to_str().unwrap().to_string();

    // One connection each way, in through node 4, out through node 1.
    random_file(&p("a.img"), 64);
    ok(Command::new("nbdcopy").args(["--connections=1", &s(&p("a.img")), &c.uri(4, "vol")]));
    ok(Command::new("nbdcopy").args(["--connections=1", &c.uri(1, "vol"), &s(&p("a.out"))]));
    cmp(&p("a.img"), &p("a.out"));
    c.verify_copies("vol");

    // Four connections each way, over the previous data, with an 8 MiB run
    // of zeros that nbdcopy sends as zero requests rather than data.
    sh(&format!(
        "set -e; cd '{}'; {{ head -c 20M /dev/urandom; head -c 8M /dev/zero; head -c 36M /dev/urandom; }} > b.img",
        tmp.path().display()
    ));
    ok(Command::new("nbdcopy").args(["--connections=4", &s(&p("b.img")), &c.uri(3, "vol")]));
    ok(Command::new("nbdcopy").args(["--connections=4", &c.uri(2, "vol"), &s(&p("b.out"))]));
    cmp(&p("b.img"), &p("b.out"));
    c.verify_copies("vol");
}

// ---------------------------------------------------------------------------
// 6. ext4 on a loop device on an nbdfuse file

/// An nbdfuse process serving `dir/disk`; unmounted (and reaped) on drop.
struct Fuse {
    dir: PathBuf,
    child: Option<Child>,
    log: PathBuf,
}

impl Fuse {
    fn start(dir: &Path, uri: &str) -> Fuse {
        std::fs::create_dir_all(dir).unwrap();
        let log = dir.with_extension("log");
        let pidfile = dir.with_extension("pid");
        let _ = std::fs::remove_file(&pidfile);
        let logf = std::fs::File::create(&log).unwrap();
        let child = Command::new("nbdfuse")
            .arg("-P")
            .arg(&pidfile)
            .arg(dir.join("disk"))
            .arg(uri)
            .stdin(Stdio::null())
            .stdout(logf.try_clone().unwrap())
            .stderr(logf)
            .spawn()
            .expect("starting nbdfuse");
        let mut f = Fuse {
            dir: dir.to_path_buf(),
            child: Some(child),
            log,
        };
        wait_for("nbdfuse serving", Duration::from_secs(20), || {
            if pidfile.exists() {
                return Ok(());
            }
            if let Some(st) = f.child.as_mut().unwrap().try_wait().unwrap() {
                f.child = None;
                panic!(
                    "nbdfuse exited ({st}) before serving {uri}; is FUSE available (/dev/fuse, fusermount3)?\n{}",
                    std::fs::read_to_string(&f.log).unwrap_or_default()
                );
            }
            Err(format!("no pid file yet; log:\n{}", f.log_text()))
        });
        f
    }

    fn disk(&self) -> PathBuf {
        self.dir.join("disk")
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Unmounts and waits for nbdfuse; returns its exit status.
    fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        // Also called from `drop`: no panic; poll, then force.
        let exited = poll_for(Duration::from_secs(20), || {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.dir)
                .output();
            match child.try_wait() {
                Ok(Some(st)) => Ok(st),
                r => Err(format!("{r:?}")),
            }
        });
        match exited {
            Ok(st) => Some(st),
            Err(_) => {
                let _ = Command::new("fusermount3")
                    .arg("-uz")
                    .arg(&self.dir)
                    .output();
                let _ = child.kill();
                let _ = child.wait();
                None
            }
        }
    }

    /// Stops nbdfuse and asserts it exited cleanly.
    fn finish(mut self) {
        let st = self.stop();
        assert!(
            st.is_some_and(|s| s.success()),
            "nbdfuse did not exit cleanly ({st:?}):\n{}",
            self.log_text()
        );
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A loop mount of `image` on `dir`; unmounted on drop.
struct LoopMount {
    dir: PathBuf,
    mounted: bool,
}

impl LoopMount {
    fn mount(image: &Path, dir: &Path) -> LoopMount {
        std::fs::create_dir_all(dir).unwrap();
        ok(Command::new("mount")
            .args(["-t", "ext4", "-o", "loop"])
            .arg(image)
            .arg(dir));
        LoopMount {
            dir: dir.to_path_buf(),
            mounted: true,
        }
    }

    fn umount(mut self) {
        self.mounted = false;
        ok(Command::new("umount").arg(&self.dir));
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        if self.mounted {
            let out = run(Command::new("umount").arg(&self.dir));
            if !out.status.success() {
                let _ = Command::new("umount").arg("-l").arg(&self.dir).output();
            }
        }
    }
}

#[test]
fn ext4_through_nbdfuse() {
    let _t = Timed::start("ext4_through_nbdfuse");
    for t in [
        "nbdfuse",
        "fusermount3",
        "mkfs.ext4",
        "e2fsck",
        "losetup",
        "mount",
        "umount",
        "sha256sum",
    ] {
        require(t);
    }
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: this test needs FUSE (modprobe fuse; in a container, --device /dev/fuse)"
    );
    let lo = run(Command::new("losetup").arg("-f"));
    assert!(
        lo.status.success(),
        "no free loop device: this test needs loop devices and root (CAP_SYS_ADMIN):\n{}",
        show(&lo)
    );

    let c = start_volume("vol", "512M");
    let tmp = tempdir();
    let root = tmp.path();
    let fs = root.join("fs");
    let sums = root.join("sums");

    // mkfs, mount, write through node 1 (which becomes the owner).
    let fuse = Fuse::start(&root.join("fuse1"), &c.uri(1, "vol"));
    assert_eq!(
        std::fs::metadata(fuse.disk()).unwrap().len(),
        512 * MIB,
        "size of the nbdfuse file"
    );
    ok(Command::new("mkfs.ext4")
        .args(["-F", "-q"])
        .arg(fuse.disk()));
    let m = LoopMount::mount(&fuse.disk(), &fs);
    sh(&format!(
        "set -e; cd '{fs}'; mkdir -p d/sub
         for i in $(seq 1 20); do head -c $((i * 150000 + 4097)) /dev/urandom > d/f$i; done
         cp d/f7 d/sub/copy; echo hello > d/sub/small
         sha256sum d/f* d/sub/* > '{sums}'; sync",
        fs = fs.display(),
        sums = sums.display()
    ));
    m.umount();
    fuse.finish();

    // Through another node (forwarding), on a fresh nbdfuse mount so that
    // nothing comes from the first one's page cache.
    let fuse = Fuse::start(&root.join("fuse3"), &c.uri(3, "vol"));
    let fsck = run(Command::new("e2fsck").arg("-fn").arg(fuse.disk()));
    assert!(
        fsck.status.success(),
        "e2fsck -fn found problems:\n{}",
        show(&fsck)
    );
    let m = LoopMount::mount(&fuse.disk(), &fs);
    let check = run(Command::new("sha256sum")
        .args(["-c", "--strict"])
        .arg(&sums)
        .current_dir(&fs));
    assert!(
        check.status.success(),
        "files changed after remount:\n{}",
        show(&check)
    );
    assert_eq!(
        String::from_utf8_lossy(&check.stdout)
            .matches(": OK")
            .count(),
        22,
        "not every file was checked:\n{}",
        show(&check)
    );
    m.umount();
    fuse.finish();
    c.verify_copies("vol");
}

// ---------------------------------------------------------------------------
// 7. Concurrent unaligned writes through every node at once

#[test]
fn concurrent_unaligned_writes_through_all_nodes() {
    let _t = Timed::start("concurrent_unaligned_writes_through_all_nodes");
    // A fresh volume with no owner yet: the first I/O arrives through all
    // four nodes at once, so the nodes race to claim it while 8 clients
    // (2 per node, 64 pipelined writes each) write unaligned 509-byte
    // slots that share every 4 KiB block: slot i of block b is at
    // b * 4096 + 3 + i * 509, filled with byte i + 1.
    const CLIENTS: u64 = 8;
    const BLOCKS: u64 = 64;
    const SLOT: u64 = 509;
    let c = start_volume("vol", "16M");
    let threads: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let addr = c.nbd_addr(i as u32 % 4 + 1);
            std::thread::spawn(move || {
                let mut conn = raw::Conn::open(&addr, "vol").expect("NBD_OPT_GO vol");
                let writes: Vec<(u64, Vec<u8>)> = (0..BLOCKS)
                    .map(|b| (b * 4096 + 3 + i * SLOT, vec![i as u8 + 1; SLOT as usize]))
                    .collect();
                let errors = conn.write_all(&writes);
                conn.disconnect();
                let failed: Vec<_> = errors.iter().filter(|&&e| e != 0).collect();
                assert!(
                    failed.is_empty(),
                    "client {i} via {addr}: {} writes failed: {failed:?}",
                    failed.len()
                );
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a writer failed");
    }

    let mut bad = Vec::new();
    for node in [1, 3] {
        let mut conn = raw::Conn::open(&c.nbd_addr(node), "vol").expect("NBD_OPT_GO vol");
        let (err, data) = conn.request(raw::CMD_READ, 0, (BLOCKS * 4096) as u32, &[]);
        assert_eq!(err, 0, "read back through node {node}");
        conn.disconnect();
        for (b, block) in data.chunks(4096).enumerate() {
            let mut want = vec![0u8; 4096];
            for i in 0..CLIENTS {
                let at = (3 + i * SLOT) as usize;
                want[at..at + SLOT as usize].fill(i as u8 + 1);
            }
            if block != want.as_slice() {
                let first = block.iter().zip(&want).position(|(x, y)| x != y).unwrap();
                bad.push(format!(
                    "node {node} block {b}: first difference at byte {first}"
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} blocks read back wrong, e.g. {:?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
    c.verify_copies("vol");
    let v = c.json(&["volume", "show", "vol"]);
    eprintln!(
        "[interop] concurrent writers: owner node {}, generation {}",
        v["volume"]["owner"], v["volume"]["generation"]
    );

    // A volume created through node 1 opens at once through every other
    // node: a node whose copy of the directory lags asks the leader how
    // far to catch up before it calls a name unknown (three rounds).
    for round in 0..3 {
        let name = format!("fresh{round}");
        c.create_volume(&name, "4M", POLICY);
        for node in 2..=4 {
            let conn = raw::Conn::open(&c.nbd_addr(node), &name);
            let conn = conn.unwrap_or_else(|e| panic!("{name} through node {node}: {e:#x}"));
            assert_eq!(conn.size, 4 << 20);
            conn.disconnect();
        }
    }
}
