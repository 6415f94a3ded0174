//! What proving and encrypting peer connections costs the transport
//! alone: 4 KiB writes at a queue depth of 32 over loopback TCP to a
//! handler that answers at once (no disk), with no proof at all, with
//! mutual TLS then the authenticated bare stream (the default), and with
//! TLS for the whole connection (`--encrypt-in-transit`). Each mode runs
//! `ROUNDS` times, alternated; the medians are printed.
//!
//!     cargo run --release -p shoal-rpc --example peer_modes [SECONDS_PER_RUN]

use bytes::Bytes;
use shoal_rpc::{serve, Handler, Peer, PeerAuth, Reply, Request, Response};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests in flight, as an owner keeps for a client at QD32.
const DEPTH: usize = 32;
/// Alternated runs of each mode.
const ROUNDS: usize = 5;

struct Ack;
impl Handler for Ack {
    fn handle(&self, _req: Request, _payload: Bytes) -> Reply {
        Box::pin(async { (Response::Ok, Bytes::new()) })
    }
}

fn security(encrypt: bool) -> PeerAuth {
    let ca = shoal_tls::new_ca("bench").expect("CA");
    let req = shoal_tls::KeyRequest::new().expect("key");
    let subject = shoal_tls::Subject::Node {
        id: 1,
        addrs: vec![],
    };
    let cert = shoal_tls::issue(&ca, "bench", &req.csr_pem, &subject).expect("cert");
    let creds = shoal_tls::NodeCredentials::from_pem(&ca.cert_pem, &cert, &req.key_pem)
        .expect("credentials");
    PeerAuth::Members(shoal_tls::PeerSecurity {
        server: creds
            .server_config(shoal_tls::ClientAuth::Required)
            .expect("server config"),
        client: creds.client_config().expect("client config"),
        encrypt,
        admit: Arc::new(|_: &shoal_tls::Member| true),
    })
}

/// Writes per second over one connection for `secs` seconds.
async fn run(auth: PeerAuth, secs: u64) -> f64 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let server = tokio::spawn(serve(l, Arc::new(Ack), auth.clone()));
    let peer = Arc::new(
        Peer::connect(&addr, Duration::from_secs(5), &auth)
            .await
            .expect("connect"),
    );
    let payload = Bytes::from(vec![0x5au8; 4096]);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for w in 0..DEPTH {
        let (peer, payload) = (peer.clone(), payload.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < end {
                let req = Request::Write {
                    component: 1,
                    generation: 1,
                    offset: (w as u64) << 12,
                    seq: n,
                };
                peer.call(&req, payload.clone(), Duration::from_secs(5))
                    .await
                    .expect("answer");
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    server.abort();
    total as f64 / secs as f64
}

/// A mode by name, and how to make its proof.
type Mode = (&'static str, fn() -> PeerAuth);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let secs: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let modes: [Mode; 3] = [
        ("unauthenticated", || PeerAuth::Unauthenticated),
        ("mutual TLS, then bare stream", || security(false)),
        ("mutual TLS, encrypted", || security(true)),
    ];
    let mut results = vec![Vec::new(); modes.len()];
    for round in 0..ROUNDS {
        for (i, (name, auth)) in modes.iter().enumerate() {
            let ops = rt.block_on(run(auth(), secs));
            println!("round {round} {name:<30} {ops:>10.0} writes/s");
            results[i].push(ops);
        }
    }
    let base = median(results[0].clone());
    println!("\nmedians over {ROUNDS} rounds of {secs} s, 4 KiB writes at QD{DEPTH}:");
    for (i, (name, _)) in modes.iter().enumerate() {
        let m = median(results[i].clone());
        println!(
            "{name:<30} {m:>10.0} writes/s  {:.2} of unauthenticated",
            m / base
        );
    }
}
