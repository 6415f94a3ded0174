//! In-process three-member directory over real HTTP on 127.0.0.1.

use shoal_directory::{
    Caller, ClusterState, Command, Directory, DirectoryConfig, DirectoryError, PlannedComponent,
    Response, StateError, Transport,
};
use shoal_model::{ComponentRole, NodeId, NodeInfo, NodeState, Policy};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A directory member with its HTTP server.
struct Member {
    id: NodeId,
    addr: SocketAddr,
    dir: Directory,
    stop: Option<oneshot::Sender<()>>,
    server: JoinHandle<()>,
}

impl Member {
    async fn start(id: NodeId, data_dir: &Path, addr: Option<SocketAddr>) -> Member {
        let bind = addr.unwrap_or_else(|| "127.0.0.1:0".parse().unwrap());
        // A restarted member binds its old port again: the old server's
        // socket may take a moment to close.
        let listener =
            wait_for(
                &format!("binding {bind}"),
                secs(10),
                || match std::net::TcpListener::bind(bind) {
                    Ok(l) => Ok(l),
                    Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(e.to_string()),
                    Err(e) => panic!("binding {bind}: {e}"),
                },
            )
            .await;
        listener.set_nonblocking(true).expect("non-blocking");
        let listener = TcpListener::from_std(listener).expect("tokio listener");
        let addr = listener.local_addr().unwrap();
        let dir = Directory::open(DirectoryConfig {
            node_id: id,
            data_dir: data_dir.to_path_buf(),
            api_addr: addr.to_string(),
            transport: plain_transport(),
        })
        .await
        .expect("open");
        let (tx, rx) = oneshot::channel::<()>();
        let router = dir.router().layer(axum::Extension(Caller::Unchecked));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await;
        });
        Member {
            id,
            addr,
            dir,
            stop: Some(tx),
            server,
        }
    }

    async fn stop(mut self) {
        self.dir.shutdown().await;
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if tokio::time::timeout(Duration::from_secs(2), &mut self.server)
            .await
            .is_err()
        {
            self.server.abort();
            // The listener closes when the aborted task is gone.
            let _ = (&mut self.server).await;
        }
    }
}

/// Polls `cond` until it holds, at most `timeout`; panics with `what` and
/// the last state `cond` described (its `Err`) if it never does. (The
/// shape of the cluster tests' `wait_for`, for async tests.)
async fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> Result<T, String>,
) -> T {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    loop {
        match cond() {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => {
                panic!("{what}: not after {timeout:?} (last: {last})")
            }
            Err(_) => {}
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// `Ok` when `holds`, else `Err` with `state` (computed only then).
fn check(holds: bool, state: impl FnOnce() -> String) -> Result<(), String> {
    if holds {
        Ok(())
    } else {
        Err(state())
    }
}

/// The leader each member believes in.
fn leaders<'a>(dirs: impl Iterator<Item = &'a Directory>) -> String {
    format!("leaders {:?}", dirs.map(|d| d.leader()).collect::<Vec<_>>())
}

fn node(id: NodeId) -> NodeInfo {
    NodeInfo {
        id,
        fault_domain: format!("node-{id}"),
        peer_addr: format!("127.0.0.1:{}", 7000 + id),
        api_addr: format!("127.0.0.1:{}", 8000 + id),
        nbd_addr: format!("127.0.0.1:{}", 10800 + id),
        state: NodeState::Up,
    }
}

fn same_state(dirs: &[&Directory]) -> bool {
    let first = dirs[0].state();
    dirs.iter().all(|d| *d.state() == *first)
}

async fn populate(via: &Directory) -> u64 {
    via.propose(Command::SetClusterId {
        cluster_id: "test".into(),
    })
    .await
    .unwrap();
    let mut devs = vec![];
    for n in 1..=3 {
        via.propose(Command::RegisterNode { node: node(n) })
            .await
            .unwrap();
        match via
            .propose(Command::RegisterDevice {
                node: n,
                path: "/data/dev0".into(),
                capacity: 1 << 30,
                store_uuid: 0,
            })
            .await
            .unwrap()
        {
            Response::Id(d) => devs.push(d),
            r => panic!("unexpected {r:?}"),
        }
    }
    let comps = vec![
        PlannedComponent {
            role: ComponentRole::Data,
            node: 1,
            device: devs[0],
            votes: 1,
        },
        PlannedComponent {
            role: ComponentRole::Data,
            node: 2,
            device: devs[1],
            votes: 1,
        },
        PlannedComponent {
            role: ComponentRole::Witness,
            node: 3,
            device: devs[2],
            votes: 1,
        },
    ];
    match via
        .propose(Command::CreateVolume {
            name: "vol1".into(),
            size: 1 << 20,
            policy: "raid1 ftt=1 reserve=100".parse::<Policy>().unwrap(),
            wrapped_key: None,
            components: comps,
        })
        .await
        .unwrap()
    {
        Response::Id(v) => v,
        r => panic!("unexpected {r:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_replicate_fail_over_and_persist() {
    let tmp: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let paths: Vec<PathBuf> = tmp.iter().map(|t| t.path().to_path_buf()).collect();

    let mut members = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        members.push(Member::start(i as NodeId + 1, p, None).await);
    }
    let addrs: Vec<SocketAddr> = members.iter().map(|m| m.addr).collect();

    // Bootstrap node 1, join 2 via 1 and 3 via 2 (forwarded to the leader).
    assert!(!members[0].dir.is_initialized().await);
    members[0].dir.bootstrap().await.unwrap();
    members[0].dir.bootstrap().await.unwrap(); // no-op
    wait_for("node 1 to lead", secs(10), || {
        check(members[0].dir.is_leader(), || {
            leaders(members.iter().map(|m| &m.dir))
        })
    })
    .await;
    members[1].dir.join(&addrs[0].to_string()).await.unwrap();
    members[2].dir.join(&addrs[1].to_string()).await.unwrap();
    members[2].dir.join(&addrs[0].to_string()).await.unwrap(); // no-op
    wait_for("three voters everywhere", secs(10), || {
        let seen: Vec<_> = members
            .iter()
            .map(|m| {
                let mut v = m.dir.voters();
                v.sort();
                (v, m.dir.members().len())
            })
            .collect();
        check(seen.iter().all(|(v, n)| *v == [1, 2, 3] && *n == 3), || {
            format!("(voters, members) per member: {seen:?}")
        })
    })
    .await;
    assert!(members[2].dir.is_initialized().await);

    // Proposals on a follower are forwarded to the leader.
    let follower = &members[2].dir;
    assert!(!follower.is_leader());
    let vol = populate(follower).await;
    let mut watch = members[1].dir.watch();
    wait_for("the same state everywhere", secs(10), || {
        check(
            same_state(&members.iter().map(|m| &m.dir).collect::<Vec<_>>()),
            || "states differ".into(),
        )
    })
    .await;
    let st = members[0].dir.state();
    assert_eq!(st.cluster_id, "test");
    assert_eq!(st.nodes.len(), 3);
    assert_eq!(st.volume_by_name("vol1").unwrap().id, vol);
    assert!(watch.borrow_and_update().volume_by_name("vol1").is_some());

    // Rejections come back as State errors, from a follower too.
    let err = follower
        .propose(Command::CreateVolume {
            name: "vol1".into(),
            size: 4096,
            policy: Policy::default(),
            wrapped_key: None,
            components: vec![],
        })
        .await
        .unwrap_err();
    assert!(
        matches!(err, DirectoryError::State(StateError::NameTaken(ref n)) if n == "vol1"),
        "{err:?}"
    );

    // A read barrier: a change made through the leader is seen on a
    // follower once `catch_up` returns, without waiting for the next
    // heartbeat to bring the commit (every round, on both followers).
    for (round, delay_s) in (100..110).enumerate() {
        members[0]
            .dir
            .propose(Command::SetRepairDelay {
                repair_delay_s: delay_s,
            })
            .await
            .unwrap();
        let m = &members[1 + round % 2].dir;
        m.catch_up(secs(5)).await.unwrap();
        assert_eq!(m.state().settings.repair_delay_s, delay_s, "round {round}");
    }

    // Compare-and-set of the owner: two concurrent claims, exactly one wins.
    let claim = |node| Command::ClaimOwner {
        volume: vol,
        node,
        expected_generation: 0,
    };
    let (a, b) = tokio::join!(
        members[1].dir.propose(claim(2)),
        members[2].dir.propose(claim(3))
    );
    let wins = [&a, &b]
        .iter()
        .filter(|r| matches!(r, Ok(Response::Claimed { generation: 1, .. })))
        .count();
    let conflicts = [&a, &b]
        .iter()
        .filter(|r| {
            matches!(
                r,
                Err(DirectoryError::State(StateError::GenerationConflict {
                    current: 1,
                    ..
                }))
            )
        })
        .count();
    assert_eq!((wins, conflicts), (1, 1), "{a:?} {b:?}");

    // Kill the leader: another is elected and proposals go on.
    let old = members[0].dir.leader().expect("a leader");
    let idx = members.iter().position(|m| m.id == old).unwrap();
    let dead = members.remove(idx);
    let dead_id = dead.id;
    dead.stop().await;
    let t0 = Instant::now();
    wait_for("a new leader", secs(15), || {
        let l = members[0].dir.leader();
        check(
            l.is_some() && l != Some(dead_id) && members.iter().all(|m| m.dir.leader() == l),
            || leaders(members.iter().map(|m| &m.dir)),
        )
    })
    .await;
    let took = t0.elapsed();
    eprintln!("new leader elected in {took:?}");
    // Generous bound: the machine is shared; the figure itself is printed above.
    assert!(took < Duration::from_secs(30), "election took {took:?}");
    let r = members[0]
        .dir
        .propose(Command::SetNodeState {
            node: dead_id,
            state: NodeState::Down,
        })
        .await
        .unwrap();
    assert_eq!(r, Response::Ok);
    wait_for("survivors to agree", secs(10), || {
        check(
            same_state(&members.iter().map(|m| &m.dir).collect::<Vec<_>>()),
            || "states differ".into(),
        )
    })
    .await;
    let before: Arc<ClusterState> = members[0].dir.state();
    assert_eq!(before.nodes[&dead_id].state, NodeState::Down);

    // Stop everything and reopen from the same folders and addresses.
    for m in members.drain(..) {
        m.stop().await;
    }
    let mut members = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        members.push(Member::start(i as NodeId + 1, p, Some(addrs[i])).await);
    }
    for m in &members {
        assert!(m.dir.is_initialized().await);
        m.dir.bootstrap().await.unwrap(); // no-op on a member
    }
    wait_for("a leader after restart", secs(15), || {
        let l = members[0].dir.leader();
        check(
            l.is_some() && members.iter().all(|m| m.dir.leader() == l),
            || leaders(members.iter().map(|m| &m.dir)),
        )
    })
    .await;
    wait_for("state restored everywhere", secs(15), || {
        check(members.iter().all(|m| *m.dir.state() == *before), || {
            "a member's state differs from the one before the restart".into()
        })
    })
    .await;
    let r = members[1]
        .dir
        .propose(Command::SetNodeState {
            node: dead_id,
            state: NodeState::Up,
        })
        .await
        .unwrap();
    assert_eq!(r, Response::Ok);
    wait_for("the same state after restart", secs(10), || {
        check(
            same_state(&members.iter().map(|m| &m.dir).collect::<Vec<_>>()),
            || "states differ".into(),
        )
    })
    .await;
    assert_eq!(members[2].dir.state().nodes[&dead_id].state, NodeState::Up);
    for m in members {
        m.stop().await;
    }
}

/// Plain HTTP between the members of these tests (a node uses mutual TLS).
fn plain_transport() -> Transport {
    Transport {
        client: reqwest::Client::builder()
            .connect_timeout(shoal_directory::CONNECT_TIMEOUT)
            .build()
            .unwrap(),
        scheme: "http",
    }
}
