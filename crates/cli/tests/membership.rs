//! Who belongs to a cluster, tried as a stranger would: frames on the peer
//! port without a certificate or with another cluster's, the directory's
//! Raft and join routes over plain HTTP and TLS, a member speaking for
//! another node, joins without a valid join token, and a revoked node.
//! Each is refused and changes nothing.

mod common;

use common::{curl, run, shoal_bin, wait_for, Cluster};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

fn tls_dir(c: &Cluster, node: u32) -> PathBuf {
    c.node_dir(node).join("tls")
}

/// curl arguments that show `node`'s certificate of cluster `c`.
fn as_member(c: &Cluster, node: u32) -> Vec<String> {
    let d = tls_dir(c, node);
    let p = |f: &str| d.join(f).display().to_string();
    vec![
        "--cacert".into(),
        p("ca-cert.pem"),
        "--cert".into(),
        p("node-cert.pem"),
        "--key".into(),
        p("node-key.pem"),
    ]
}

fn post_json(body: &str) -> Vec<String> {
    [
        "-X",
        "POST",
        "-H",
        "content-type: application/json",
        "-d",
        body,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A forged vote for `node` with a huge term.
fn forged_vote(node: u32) -> String {
    format!(
        r#"{{"vote":{{"leader_id":{{"term":999999,"node_id":{node}}},"committed":false}},"last_log_id":null}}"#
    )
}

fn register_as(node: u32, peer: &str) -> String {
    format!(
        r#"{{"RegisterNode":{{"node":{{"id":{node},"fault_domain":"x","peer_addr":"{peer}","api_addr":"{peer}","nbd_addr":"{peer}","state":"Up"}}}}}}"#
    )
}

#[test]
fn strangers_and_impostors_are_refused_on_every_route_between_nodes() {
    common::require("curl");
    common::require("qemu-io");
    let c = Cluster::start(3);
    let other = Cluster::start(1);
    c.create_volume("v", "64M", "raid1 ftt=1");
    let uri = c.uri(1, "v");
    run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x11 0 1M", &uri]));
    let term_before = c.json(&["status"]).to_string();

    let api = |n: u32| c.api(n); // http://ip:port
    let tls_api = |n: u32| api(n).replacen("http://", "https://", 1);
    let routes = [
        "/raft/vote",
        "/raft/append",
        "/directory/join",
        "/directory/propose",
        "/directory/read-index",
    ];

    // Plain HTTP: the routes between nodes are not there at all.
    for r in routes.iter().chain(&["/v1/heartbeat"]) {
        let (code, body) = curl(
            &format!("{}{r}", api(1)),
            &refs(&post_json(&forged_vote(9))),
        );
        assert_eq!(code, 404, "{r} over plain HTTP: {body}");
    }
    // TLS without a certificate: only /v1/join.
    for r in routes.iter().chain(&["/v1/heartbeat"]) {
        let mut a = post_json(&forged_vote(9));
        a.push("-k".into());
        let (code, body) = curl(&format!("{}{r}", tls_api(1)), &refs(&a));
        assert_eq!(code, 404, "{r} over TLS without a certificate: {body}");
    }
    // Another cluster's node: no handshake at all.
    for r in ["/raft/vote", "/v1/heartbeat"] {
        let mut a = post_json(&forged_vote(1));
        a.extend(as_member(&other, 1));
        a.push("-k".into());
        let (code, body) = curl(&format!("{}{r}", tls_api(1)), &refs(&a));
        assert_eq!(code, 0, "{r} with another cluster's certificate: {body}");
    }

    // A member speaking for another node: refused, whatever it claims.
    let me2 = as_member(&c, 2);
    let with = |body: &str| {
        let mut a = post_json(body);
        a.extend(me2.clone());
        a
    };
    let (code, body) = curl(
        &format!("{}/raft/vote", tls_api(1)),
        &refs(&with(&forged_vote(3))),
    );
    assert_eq!(code, 403, "node 2 voting as node 3: {body}");
    let hb3 = r#"{"node":3,"devices":[{"device":3,"used":0,"state":"Failed"}]}"#;
    let (code, body) = curl(&format!("{}/v1/heartbeat", tls_api(1)), &refs(&with(hb3)));
    assert_eq!(code, 403, "node 2 sending node 3's heartbeat: {body}");
    let fake = "127.0.0.9:9";
    for n in 1..=3 {
        let (code, body) = curl(
            &format!("{}/directory/propose", tls_api(n)),
            &refs(&with(&register_as(3, fake))),
        );
        assert!(
            code == 200 && body.contains("Forbidden"),
            "node 2 registering node 3 via node {n}: {code} {body}"
        );
    }
    let join3 = r#"{"node_id":3,"addr":"127.0.0.9:9","forwarded":false}"#;
    let (code, body) = curl(
        &format!("{}/directory/join", tls_api(1)),
        &refs(&with(join3)),
    );
    assert!(code == 200 && body.contains("Forbidden"), "{code} {body}");
    // The same member speaking for itself is heard (the refusals above
    // are about identity, not a broken route).
    let hb2 = r#"{"node":2,"devices":[]}"#;
    let (code, body) = curl(&format!("{}/v1/heartbeat", tls_api(1)), &refs(&with(hb2)));
    assert_eq!(code, 200, "node 2's own heartbeat: {body}");

    // Frames on the peer port without a certificate, or with another
    // cluster's: the connection is refused before any frame is read.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let peer = c.peer_addr(2);
    let write = shoal_rpc::Request::Write {
        component: 1,
        generation: u64::MAX / 2,
        offset: 0,
        seq: 1,
    };
    rt.block_on(async {
        let t = Duration::from_secs(3);
        let plain = shoal_rpc::Peer::connect(&peer, t, &shoal_rpc::PeerAuth::Unauthenticated)
            .await
            .expect("the TCP connection itself opens");
        let r = plain
            .call(&write, bytes::Bytes::from(vec![0xee; 4096]), t)
            .await;
        assert!(
            r.is_err(),
            "a frame without a certificate was answered: {r:?}"
        );
        let foreign = member_auth(&tls_dir(&other, 1));
        let r = shoal_rpc::Peer::connect(&peer, t, &foreign).await;
        assert!(r.is_err(), "another cluster's node connected");
    });

    // Nothing changed: the data, the copies, the nodes' addresses, health.
    let out = run(Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x11 0 1M", &uri]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    c.verify_copies("v");
    let st = c.json(&["status"]);
    let n3 = st["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == 3)
        .unwrap();
    assert_ne!(n3["peer_addr"], fake, "{n3}");
    assert_eq!(c.health("v"), "healthy");
    let devices = st["devices"].as_array().unwrap();
    assert!(
        devices.iter().all(|d| d["state"] == "Healthy"),
        "{devices:?}"
    );
    assert_eq!(
        st["leader"],
        serde_json::from_str::<serde_json::Value>(&term_before).unwrap()["leader"]
    );
}

/// Mutual TLS with the credentials in `dir` (a node's `DATA/tls`).
fn member_auth(dir: &Path) -> shoal_rpc::PeerAuth {
    let creds = shoal_tls::NodeCredentials::load(dir).unwrap().unwrap();
    shoal_rpc::PeerAuth::Members(shoal_tls::PeerSecurity {
        server: creds
            .server_config(shoal_tls::ClientAuth::Required)
            .unwrap(),
        client: creds.client_config().unwrap(),
        encrypt: false,
        admit: std::sync::Arc::new(|_: &shoal_tls::Member| true),
    })
}

/// `shoal node` for node `id` on the addresses of host `id` of `c`'s
/// subnet (host `id + 4` with `other_host`), with its own folder under
/// `dir`, joining through node 1 with `token` (none: no token at all).
fn joiner(c: &Cluster, id: u32, dir: &Path, token: Option<&str>) -> Command {
    joiner_on(c, id, id, dir, token)
}

fn joiner_on(c: &Cluster, id: u32, host: u32, dir: &Path, token: Option<&str>) -> Command {
    let data = dir.join(format!("joiner{id}"));
    let mut cmd = Command::new(shoal_bin());
    cmd.args(["node", "--id", &id.to_string(), "--data"])
        .arg(&data)
        .arg("--device")
        .arg(format!("{}:2G", data.join("dev0.img").display()))
        .args(["--api", &c.api_addr(host), "--nbd", &c.nbd_addr(host)])
        .args(["--peer", &c.peer_addr(host), "--nbd-socket", "none"])
        .args(["--join", &c.api_addr(1)])
        .env_remove("SHOAL_JOIN_TOKEN");
    if let Some(t) = token {
        cmd.env("SHOAL_JOIN_TOKEN", t);
    }
    cmd
}

/// Runs a joiner that must fail; its error output.
fn join_fails(c: &Cluster, id: u32, dir: &Path, token: Option<&str>) -> String {
    let out = run(joiner(c, id, dir, token).stdin(std::process::Stdio::null()));
    assert!(
        !out.status.success(),
        "node {id} joined with token {token:?}"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Kills the child on drop.
struct Node(Child);
impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn new_token(c: &Cluster, args: &[&str]) -> String {
    let mut a = vec!["token", "create"];
    a.extend_from_slice(args);
    c.shoal(&a).trim().to_string()
}

#[test]
fn a_node_joins_only_with_a_valid_join_token_and_a_revoked_node_is_cut_off() {
    let c = Cluster::start(1);
    let other = Cluster::start(1);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();

    let e = join_fails(&c, 2, dir, None);
    assert!(e.contains("needs a join token"), "{e}");
    let admin = c.token();
    let e = join_fails(&c, 2, dir, Some(&admin));
    assert!(e.contains("not a join token"), "{e}");
    // Another cluster's join token names another CA: not sent to this one.
    let foreign = new_token(&other, &["--join"]);
    let e = join_fails(&c, 2, dir, Some(&foreign));
    assert!(e.contains("join token"), "{e}");
    // A revoked one, an expired one.
    let revoked = new_token(&c, &["--join"]);
    let id = revoked.split('-').nth(2).unwrap().to_string();
    c.shoal(&["token", "revoke", &id]);
    let e = join_fails(&c, 2, dir, Some(&revoked));
    assert!(e.contains("not valid here"), "{e}");
    let short = new_token(&c, &["--join", "--ttl", "1s"]);
    std::thread::sleep(Duration::from_millis(1100));
    let e = join_fails(&c, 2, dir, Some(&short));
    assert!(e.contains("expired"), "{e}");
    // A join token opens nothing on the REST API.
    let good = new_token(&c, &["--join", "--note", "node 2"]);
    let (code, body) = curl(
        &format!("{}/v1/status", c.api(1)),
        &["-H", &format!("Authorization: Bearer {good}")],
    );
    assert_eq!(code, 401, "{body}");
    assert_eq!(
        c.json(&["status"])["nodes"].as_array().unwrap().len(),
        1,
        "no refused join left a node behind"
    );

    // The valid token: node 2 joins, with its own key and certificate.
    let log = std::fs::File::create(dir.join("joiner2.log")).unwrap();
    let n2 = Node(
        joiner(&c, 2, dir, Some(&good))
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    c.wait_node(2, "up", Duration::from_secs(60));
    let certs = dir.join("joiner2/tls");
    assert!(certs.join("node-key.pem").exists() && certs.join("node-cert.pem").exists());
    // The same id again, from another folder, with a new token: refused.
    let again = new_token(&c, &["--join"]);
    let out =
        run(joiner_on(&c, 2, 6, &dir.join("again"), Some(&again))
            .stdin(std::process::Stdio::null()));
    assert!(!out.status.success(), "a second node 2 joined");
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("already a member"), "{e}");

    // Revoked: node 1 refuses node 2's connections and closes those it
    // holds; node 2's heartbeats stop reaching the leader: it goes down.
    c.shoal(&["cluster", "revoke-node", "2"]);
    c.wait_node(2, "down", Duration::from_secs(30));
    let peer1 = c.peer_addr(1);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let auth = member_auth(&certs);
        let r = shoal_rpc::Peer::connect(&peer1, Duration::from_secs(3), &auth).await;
        let refused = match r {
            Err(_) => true,
            Ok(p) => p
                .call(
                    &shoal_rpc::Request::Ping,
                    bytes::Bytes::new(),
                    Duration::from_secs(3),
                )
                .await
                .is_err(),
        };
        assert!(
            refused,
            "a revoked node's certificate still opens the peer port"
        );
    });
    wait_for("node 1 logs the refusal", Duration::from_secs(10), || {
        let log = std::fs::read_to_string(c.node_dir(1).join("node.log")).unwrap_or_default();
        if log.contains("revoked") {
            Ok(())
        } else {
            Err("no refusal logged".to_string())
        }
    });
    drop(n2);
}

/// What an insider (a member's certificate) can still do: fence a copy by
/// activating it under a huge generation. The cluster must say so, not
/// report healthy, and not re-claim the volume in a storm.
#[test]
fn a_copy_fenced_by_an_insider_turns_health_away_from_healthy() {
    common::require("qemu-io");
    let c = Cluster::start(3);
    c.create_volume("v", "64M", "raid1 ftt=1");
    let uri = c.uri(1, "v");
    let out = run(Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x21 0 64k", &uri]));
    assert!(out.status.success());
    let st = c.json(&["status"]);
    let v = &st["volumes"][0]["volume"];
    let owner = v["owner"].as_u64().expect("an owner after a write");
    let copy = v["components"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["role"] == "Data" && x["node"].as_u64() != Some(owner))
        .expect("a copy on another node")
        .clone();
    let (component, node) = (
        copy["id"].as_u64().unwrap(),
        copy["node"].as_u64().unwrap() as u32,
    );
    let insider = if node == 3 { 2 } else { 3 };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let auth = member_auth(&tls_dir(&c, insider));
        let t = Duration::from_secs(3);
        let p = shoal_rpc::Peer::connect(&c.peer_addr(node), t, &auth)
            .await
            .unwrap();
        let fence = shoal_rpc::Request::Activate {
            component,
            generation: 1 << 40,
        };
        p.call(&fence, bytes::Bytes::new(), t).await.unwrap();
    });
    let claims_before = c.metric(&[1, 2, 3], "shoal_owner_claims_total");
    // A client keeps writing (it may well fail: the volume is fenced).
    let mut writer = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x22 0 64k", &uri])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let health = wait_for("health away from healthy", Duration::from_secs(30), || {
        let h = c.health("v");
        if h == "healthy" {
            Err(h)
        } else {
            Ok(h)
        }
    });
    if health == "inaccessible" {
        let st = c.json(&["status"]);
        let problem = st["volumes"][0]["volume"]["problem"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(problem.contains("activation"), "no reason given: {st}");
    }
    // Claims stay rare while the client retries: one per node per
    // START_RETRY_PAUSE (2 s) at most, not one per retry.
    common::holds_for("no claim storm", Duration::from_secs(6), || {
        let claims = c.metric(&[1, 2, 3], "shoal_owner_claims_total") - claims_before;
        if claims <= 16 {
            Ok(())
        } else {
            Err(format!("{claims} claims since the fence ({health})"))
        }
    });
    let _ = writer.kill();
    let _ = writer.wait();
}
