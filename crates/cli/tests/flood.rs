//! A node under a flood of idle connections on every port from one host:
//! its descriptors and memory stay under the stated bounds, other clients
//! keep being served, and the flood's connections are closed once their
//! handshake time is up.

mod common;

use common::{holds_for, run, wait_for, Cluster};
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

/// The flooding host: an address of its own, outside every test subnet.
const FLOODER: &str = "127.0.99.1";
/// Connections the flood opens to each port: several times any port's
/// per-address bound.
const FLOOD_PER_PORT: usize = 600;
/// Per-address bounds of the ports (API, peer, NBD), as the code states
/// them (`MAX_API_CONNECTIONS_PER_ADDRESS`,
/// `MAX_PEER_CONNECTIONS_PER_ADDRESS`, `MAX_CONNECTIONS_PER_ADDRESS`).
const PER_ADDRESS: [usize; 3] = [128, 256, 128];
/// Descriptors a node may use beyond its own before the flood (its
/// connections to peers and clients come and go).
const FD_SLACK: usize = 64;
/// Memory the flood may add to the node, in MiB.
const RSS_SLACK_MIB: u64 = 64;

fn fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn rss_mib(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0, |kib| kib / 1024)
}

/// Lets this process hold the flood's descriptors.
fn raise_own_limit() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain system calls with valid structs.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
    }
    assert!(
        l.rlim_cur as usize > 3 * FLOOD_PER_PORT + 256,
        "the descriptor limit {} is too low for this test",
        l.rlim_cur
    );
}

/// Opens `n` connections to `to` from [`FLOODER`] and keeps them idle.
async fn flood(to: SocketAddr, n: usize) -> Vec<tokio::net::TcpStream> {
    let mut held = Vec::new();
    for _ in 0..n {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(format!("{FLOODER}:0").parse().unwrap()).unwrap();
        if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(2), s.connect(to)).await {
            held.push(c);
        }
    }
    held
}

#[test]
fn a_flood_of_idle_connections_on_every_port_is_bounded_and_others_are_served() {
    common::require("qemu-io");
    raise_own_limit();
    let c = Cluster::start(3);
    c.create_volume("v", "64M", "raid1 ftt=1");
    let write = |node: u32, pat: &str| {
        let out = run(Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            &format!("write -P {pat} 0 1M"),
            "-c",
            &format!("read -P {pat} 0 1M"),
            &c.uri(node, "v"),
        ]));
        assert!(
            out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("fail"),
            "qemu-io via node {node}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    };
    write(1, "0x22");
    let pid = c.pid(1);
    let (fd0, rss0) = (fds(pid), rss_mib(pid));

    let rt = tokio::runtime::Runtime::new().unwrap();
    let ports = [c.api_addr(1), c.peer_addr(1), c.nbd_addr(1)];
    let held: Vec<_> = rt.block_on(async {
        let mut all = Vec::new();
        for p in &ports {
            all.extend(flood(p.parse().unwrap(), FLOOD_PER_PORT).await);
        }
        all
    });
    let bound = fd0 + PER_ADDRESS.iter().sum::<usize>() + FD_SLACK;
    holds_for(
        "node 1's descriptors stay bounded",
        Duration::from_secs(3),
        || {
            let n = fds(pid);
            if n <= bound {
                Ok(())
            } else {
                Err(format!("{n} descriptors (bound {bound}, {fd0} before)"))
            }
        },
    );
    // Everyone else is served meanwhile: the API, NBD through the flooded
    // node, and writes that node 1 replicates over its peer port.
    c.shoal(&["status"]);
    write(1, "0x33");
    write(2, "0x44");
    let rss = rss_mib(pid);
    assert!(
        rss <= rss0 + RSS_SLACK_MIB,
        "node 1 grew from {rss0} to {rss} MiB under the flood"
    );
    // The node closes what never finished its handshake.
    wait_for(
        "the flood's connections closed",
        Duration::from_secs(30),
        || {
            let n = fds(pid);
            if n <= fd0 + FD_SLACK / 4 {
                Ok(())
            } else {
                Err(format!("{n} descriptors ({fd0} before)"))
            }
        },
    );
    drop(held);
    c.verify_copies("v");
}
