//! Bounded fuzzing of a running node's decoders through its real ports:
//! NBD option haggling, REST requests (with and without a token), the
//! peer port and the TLS side of the API port get random and mutated
//! input from a seeded generator for a bounded number of cases. Every
//! case may be refused; none may take a node down, change the data, or
//! leave a panic in a log. The seed is printed, so a failure replays.

mod common;

use common::{run, Cluster};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

/// Cases per port: a few seconds of the suite's time in all.
const CASES_PER_PORT: usize = 250;
/// Largest random input of one case, in bytes.
const MAX_INPUT_BYTES: usize = 4096;
/// How long a case waits for the node's answer.
const ANSWER_WAIT_MS: u64 = 100;

/// xorshift64*: small, seeded, the same sequence everywhere.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Up to `max` random bytes.
    fn some_bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max);
        self.bytes(n)
    }
    /// `v` with a few bytes flipped, cut or repeated.
    fn mutate(&mut self, v: &[u8]) -> Vec<u8> {
        let mut out = v.to_vec();
        for _ in 0..1 + self.below(4) {
            if out.is_empty() {
                break;
            }
            let i = self.below(out.len());
            match self.below(4) {
                0 => out[i] = self.next() as u8,
                1 => out.truncate(i),
                2 => out.insert(i, self.next() as u8),
                _ => {
                    let chunk = out[i..].to_vec();
                    out.extend_from_slice(&chunk[..chunk.len().min(64)]);
                }
            }
        }
        out
    }
}

/// Sends `input` on a new connection and reads what comes back for a
/// moment; any outcome is fine but a hang.
fn poke(addr: &str, input: &[u8]) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return;
    };
    let _ = s.set_write_timeout(Some(Duration::from_millis(ANSWER_WAIT_MS)));
    let _ = s.set_read_timeout(Some(Duration::from_millis(ANSWER_WAIT_MS)));
    let _ = s.write_all(input);
    let mut buf = [0u8; 4096];
    let _ = s.read(&mut buf);
}

/// The NBD client's side of the handshake up to option haggling: the
/// server's greeting is read, fixed newstyle with no zeroes is asked.
fn nbd_options(rng: &mut Rng) -> Vec<u8> {
    let mut v = 0x0000_0001u32.to_be_bytes().to_vec(); // client flags
    for _ in 0..1 + rng.below(3) {
        v.extend_from_slice(&0x4948_4156_454F_5054u64.to_be_bytes()); // IHAVEOPT
        let option = [1u32, 3, 6, 7, 8, 9, 10, 5, rng.next() as u32][rng.below(9)];
        let data = rng.some_bytes(256);
        let len = if rng.below(5) == 0 {
            rng.next() as u32
        } else {
            data.len() as u32
        };
        v.extend_from_slice(&option.to_be_bytes());
        v.extend_from_slice(&len.to_be_bytes());
        v.extend_from_slice(&data);
    }
    rng.mutate(&v)
}

/// A REST request: a real route or a near one, a method, maybe a
/// read-only token, a body mutated from a valid one.
fn rest_request(rng: &mut Rng, host: &str, token: &str) -> Vec<u8> {
    const PATHS: &[&str] = &[
        "/v1/volumes",
        "/v1/volumes/v",
        "/v1/volumes/v/resize",
        "/v1/volumes/v/settings",
        "/v1/volumes/%2e%2e",
        "/v1/tokens",
        "/v1/nodes/2/revoke",
        "/v1/scrub",
        "/v1/join",
        "/raft/vote",
        "/directory/propose",
        "/directory/read-index",
        "/v1/devices",
        "/v1/devices/1/keep",
        "/v1/local/devices/1/blocked",
        "/v1/heartbeat",
        "/metrics",
        "/livez",
    ];
    const BODIES: &[&str] = &[
        r#"{"name":"f","size":4096,"policy":"raid1 ftt=1"}"#,
        r#"{"size":134217728}"#,
        r#"{"iops_limit":100}"#,
        r#"{"role":"read-only","note":"x"}"#,
        r#"{"token":"shoal-join-0-0-0","node":9,"addrs":[],"csr_pem":""}"#,
    ];
    let method = ["GET", "POST", "DELETE", "PUT", "G\0T"][rng.below(5)];
    let path = PATHS[rng.below(PATHS.len())];
    let pick = BODIES[rng.below(BODIES.len())];
    let body = rng.mutate(pick.as_bytes());
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n");
    if rng.below(2) == 0 {
        req.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    req.push_str("Content-Type: application/json\r\n");
    let len = if rng.below(6) == 0 {
        rng.next() % (1 << 30)
    } else {
        body.len() as u64
    };
    req.push_str(&format!("Content-Length: {len}\r\n\r\n"));
    let mut v = req.into_bytes();
    v.extend_from_slice(&body);
    if rng.below(4) == 0 {
        v = rng.mutate(&v);
    }
    v
}

#[test]
fn random_and_mutated_input_on_every_port_changes_nothing() {
    common::require("qemu-io");
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        | 1;
    eprintln!("fuzz seed {seed:#x}");
    let mut rng = Rng(seed);
    let c = Cluster::start(3);
    c.create_volume("v", "64M", "raid1 ftt=1");
    let uri = c.uri(1, "v");
    let io = |cmd: &str| {
        let out = run(Command::new("qemu-io").args(["-f", "raw", "-c", cmd, &uri]));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success() && !text.contains("fail"),
            "{cmd}: {text}"
        );
    };
    io("write -P 0x5c 0 1M");
    let pids: Vec<i32> = (1..=3).map(|n| c.pid(n)).collect();
    // A read-only token: whatever the fuzzer sends with it, nothing may
    // change (with the admin token, a mutated request may well be a valid
    // change).
    let token = c
        .shoal(&["token", "create", "--role", "read-only", "--note", "fuzz"])
        .trim()
        .to_string();

    for _ in 0..CASES_PER_PORT {
        let n = 1 + rng.below(3) as u32;
        let nbd = nbd_options(&mut rng);
        poke(&c.nbd_addr(n), &nbd);
        let rest = rest_request(&mut rng, &c.api_addr(n), &token);
        poke(&c.api_addr(n), &rest);
        let mut tls = vec![0x16, 0x03, 0x01];
        tls.extend(rng.some_bytes(MAX_INPUT_BYTES));
        poke(&c.api_addr(n), &tls);
        let peer = if rng.below(2) == 0 {
            rng.some_bytes(MAX_INPUT_BYTES)
        } else {
            tls.clone()
        };
        poke(&c.peer_addr(n), &peer);
    }

    // Every node is the process it was, serves, and nothing changed.
    for (i, pid) in pids.iter().enumerate() {
        assert!(
            common::pid_alive(*pid),
            "node {} died (seed {seed:#x})",
            i + 1
        );
    }
    c.shoal(&["status"]);
    io("read -P 0x5c 0 1M");
    c.verify_copies("v");
    let vols = c.json(&["volume", "list"]);
    assert_eq!(
        vols.as_array().map(|v| v.len()),
        Some(1),
        "the fuzzing made or deleted a volume (seed {seed:#x}): {vols}"
    );
    assert!(
        !c.logs().contains("panic"),
        "a panic (seed {seed:#x}):\n{}",
        c.logs()
    );
}
