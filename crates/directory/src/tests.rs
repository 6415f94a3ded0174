//! Snapshots: built, persisted, used after log purge to catch up a new
//! member over HTTP, and reloaded at restart.

use super::*;
use std::net::SocketAddr;
use std::path::Path;
use tokio::net::TcpListener;

async fn start(
    id: NodeId,
    dir: &Path,
    addr: Option<SocketAddr>,
) -> (Directory, SocketAddr, tokio::task::JoinHandle<()>) {
    let want = addr.unwrap_or_else(|| "127.0.0.1:0".parse().unwrap());
    // A restart binds its old port again: the socket of the old server
    // may take a moment to close, so retry for a while.
    let started = Instant::now();
    let listener = loop {
        match TcpListener::bind(want).await {
            Ok(l) => break l,
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && started.elapsed() < Duration::from_secs(10) =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("binding {want}: {e}"),
        }
    };
    let addr = listener.local_addr().unwrap();
    let d = Directory::open(DirectoryConfig {
        node_id: id,
        data_dir: dir.to_path_buf(),
        api_addr: addr.to_string(),
        transport: plain_transport(),
    })
    .await
    .unwrap();
    let router = d.router().layer(axum::Extension(Caller::Unchecked));
    let h = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    (d, addr, h)
}

async fn wait_for<F: FnMut() -> bool>(what: &str, mut f: F) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_catches_up_a_new_member_and_survives_restart() {
    let t1 = tempfile::tempdir().unwrap();
    let t2 = tempfile::tempdir().unwrap();
    let (d1, a1, h1) = start(1, t1.path(), None).await;
    d1.bootstrap().await.unwrap();
    wait_for("leader", || d1.is_leader()).await;
    d1.propose(Command::SetClusterId {
        cluster_id: "snap".into(),
    })
    .await
    .unwrap();
    for n in 1..=20 {
        let node = shoal_model::NodeInfo {
            id: n,
            fault_domain: format!("node-{n}"),
            peer_addr: String::new(),
            api_addr: String::new(),
            nbd_addr: String::new(),
            state: shoal_model::NodeState::Up,
        };
        d1.propose(Command::RegisterNode { node }).await.unwrap();
    }

    // Snapshot, then purge every log entry it covers.
    let raft = &d1.inner.raft;
    raft.trigger().snapshot().await.unwrap();
    wait_for("snapshot", || d1.inner.metrics.borrow().snapshot.is_some()).await;
    let upto = d1.inner.metrics.borrow().snapshot.unwrap().index;
    raft.trigger().purge_log(upto).await.unwrap();
    wait_for("purge", || {
        d1.inner.metrics.borrow().purged.map(|l| l.index) == Some(upto)
    })
    .await;

    // A new member can only catch up from the snapshot.
    let (d2, a2, h2) = start(2, t2.path(), None).await;
    d2.join(&a1.to_string()).await.unwrap();
    wait_for("replicated state", || *d2.state() == *d1.state()).await;
    assert_eq!(d2.state().nodes.len(), 20);
    // The promotion to voter reaches node 2's view a moment after the data.
    wait_for("node 2 promoted to voter", || d2.voters().len() == 2).await;
    d2.propose(Command::SetClusterId {
        cluster_id: "snap".into(),
    })
    .await
    .unwrap();
    let before = d1.state();

    // Restart both: state comes back from snapshot plus log replay.
    for (d, h) in [(d1, h1), (d2, h2)] {
        d.shutdown().await;
        h.abort();
        // The listener closes when the aborted task is gone.
        let _ = h.await;
    }
    let (d1, _, h1) = start(1, t1.path(), Some(a1)).await;
    let (d2, _, h2) = start(2, t2.path(), Some(a2)).await;
    assert_eq!(*d1.state(), *before, "node 1 state restored at open");
    wait_for("node 2 state restored", || *d2.state() == *before).await;
    wait_for("leader after restart", || d1.leader().is_some()).await;
    d2.propose(Command::SetClusterId {
        cluster_id: "snap".into(),
    })
    .await
    .unwrap();
    for (d, h) in [(d1, h1), (d2, h2)] {
        d.shutdown().await;
        h.abort();
        // The listener closes when the aborted task is gone.
        let _ = h.await;
    }
}

/// A voter is removed through a member that is not the leader (the
/// request is forwarded), then a learner-less two-voter cluster goes on
/// deciding; removing it again is Ok, and the last voter cannot go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_voter_is_removed_through_any_member() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut members = Vec::new();
    for (i, t) in dirs.iter().enumerate() {
        members.push(start(i as NodeId + 1, t.path(), None).await);
    }
    let (d1, a1, _) = &members[0];
    d1.bootstrap().await.unwrap();
    wait_for("leader", || d1.is_leader()).await;
    for (d, _, _) in &members[1..] {
        d.join(&a1.to_string()).await.unwrap();
    }
    wait_for("three voters", || members[2].0.voters().len() == 3).await;
    let d2 = &members[1].0;
    d2.remove_member(3).await.unwrap();
    wait_for("node 3 removed", || {
        d1.voters() == vec![1, 2] && d2.members() == vec![1, 2]
    })
    .await;
    d2.remove_member(3).await.unwrap();
    d2.propose(Command::SetClusterId {
        cluster_id: "rm".into(),
    })
    .await
    .unwrap();
    d1.remove_member(2).await.unwrap();
    wait_for("node 2 removed", || d1.voters() == vec![1]).await;
    let e = d1.remove_member(1).await.unwrap_err();
    assert!(e.to_string().contains("only voter"), "{e}");
    for (d, _, h) in members {
        d.shutdown().await;
        h.abort();
        let _ = h.await;
    }
}

/// Plain HTTP between the members of these tests (a node uses mutual TLS).
fn plain_transport() -> Transport {
    Transport {
        client: reqwest::Client::builder()
            .connect_timeout(crate::CONNECT_TIMEOUT)
            .build()
            .unwrap(),
        scheme: "http",
    }
}
