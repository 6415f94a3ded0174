//! Server side: accept peers and run their requests through a [`Handler`].

use crate::frame::{Header, FLAG_REPLY, HEADER_LEN};
use crate::{PeerAuth, RemoteError, Request, Response};
use bytes::Bytes;
use shoal_tls::MemberStream;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};

/// The rest of a request's work, run concurrently with later requests.
pub type Reply = Pin<Box<dyn Future<Output = (Response, Bytes)> + Send>>;

/// Executes requests. `handle` is called in arrival order for the frames of
/// one connection and must do synchronously whatever has to keep that order
/// (applying a write); the returned future does the rest (waiting for
/// durability, reading) and may finish out of order.
pub trait Handler: Send + Sync + 'static {
    fn handle(&self, req: Request, payload: Bytes) -> Reply;
}

/// Pause after a failed `accept` (descriptors used up, a network error)
/// before the next one: long enough not to spin, short enough that peers
/// are served again soon after the cause goes.
const ACCEPT_RETRY_MS: u64 = 50;

/// Peer connections served at once by one node: a cluster of dozens of
/// nodes opens a few per node; past this, new connections are closed at
/// once, so a flood of connections cannot use up the node's descriptors.
pub const MAX_PEER_CONNECTIONS: usize = 512;

/// Peer connections from one address at once: half the port, so one host
/// cannot take every slot (a stranger's connections end at the handshake,
/// within `HANDSHAKE_TIMEOUT_MS`). A node's owners open one connection per
/// copy of each volume they own, so a host with many volumes needs many.
pub const MAX_PEER_CONNECTIONS_PER_ADDRESS: usize = MAX_PEER_CONNECTIONS / 2;

/// Requests of one peer connection being served at once: an owner keeps
/// at most its clients' queue depths in flight; past this the node stops
/// reading the connection until replies go out.
pub const MAX_REQUESTS_IN_FLIGHT_PER_CONNECTION: usize = 1024;

/// Bytes one peer connection may hold in the node at once (payloads of
/// requests being served and of replies not yet written), in MiB: a peer
/// that does not read its replies stops being read instead of growing the
/// node. At least one largest frame ([`crate::MAX_PAYLOAD`]) fits.
pub const MAX_BYTES_IN_FLIGHT_PER_CONNECTION_MIB: usize = 128;

/// The same bound for all peer connections of the node together, in MiB.
pub const MAX_PEER_BYTES_IN_FLIGHT_MIB: usize = 1024;

/// Unit of the byte budgets, in bytes.
const BUDGET_UNIT_BYTES: usize = 4096;

/// What a request holds of the budgets while it is served and its reply
/// waits to be written.
struct Held {
    _requests: tokio::sync::OwnedSemaphorePermit,
    _bytes: tokio::sync::OwnedSemaphorePermit,
    _node_bytes: tokio::sync::OwnedSemaphorePermit,
}

/// The node-wide budgets shared by every peer connection.
#[derive(Clone)]
struct Budgets {
    connections: Arc<Semaphore>,
    per_address: crate::PerAddress,
    node_bytes: Arc<Semaphore>,
}

/// Accepts peers for as long as the node runs; each connection runs on
/// its own task, and a bad frame closes only that connection. A failed
/// `accept` (e.g. `EMFILE`) is logged and tried again: it never stops the
/// server, which would leave the node alive with a dead peer port.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    handler: Arc<H>,
    auth: PeerAuth,
) -> std::io::Result<()> {
    let budgets = Budgets {
        connections: Arc::new(Semaphore::new(MAX_PEER_CONNECTIONS)),
        per_address: crate::PerAddress::new(MAX_PEER_CONNECTIONS_PER_ADDRESS),
        node_bytes: Arc::new(Semaphore::new(units(MAX_PEER_BYTES_IN_FLIGHT_MIB << 20))),
    };
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "peer accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(ACCEPT_RETRY_MS)).await;
                continue;
            }
        };
        let Ok(slot) = budgets.connections.clone().try_acquire_owned() else {
            tracing::warn!(%from, "peer connection refused: {MAX_PEER_CONNECTIONS} already open");
            drop(stream);
            continue;
        };
        let Some(held) = budgets.per_address.take(from.ip()) else {
            tracing::warn!(
                %from,
                "peer connection refused: {MAX_PEER_CONNECTIONS_PER_ADDRESS} already open from its address"
            );
            continue;
        };
        let (h, b, a) = (handler.clone(), budgets.clone(), auth.clone());
        tokio::spawn(async move {
            // The handshake runs inside the connection's slot and within
            // HANDSHAKE_TIMEOUT_MS: nothing is read before it proves a member.
            match open(stream, &a).await {
                Ok((s, member)) => {
                    let served = run(s, h, b);
                    let r = match (&a, member) {
                        // Served until the member's certificate is revoked.
                        (PeerAuth::Members(sec), Some(m)) => tokio::select! {
                            r = served => r,
                            () = shoal_tls::until_revoked(&sec.admit, &m) => {
                                Err(std::io::Error::other("certificate revoked"))
                            }
                        },
                        _ => served.await,
                    };
                    if let Err(e) = r {
                        tracing::debug!(%from, "peer connection closed: {e}");
                    }
                }
                Err(e) => tracing::warn!(%from, "peer connection refused: {e}"),
            }
            drop((slot, held));
        });
    }
}

/// Budget units of `bytes` (at least one).
fn units(bytes: usize) -> usize {
    bytes.div_ceil(BUDGET_UNIT_BYTES).max(1)
}

/// Payload bytes the reply to `req` will carry, as far as the request
/// tells.
fn reply_bytes(req: &Request) -> usize {
    match req {
        Request::Read { len, .. } => *len as usize,
        Request::VolumeIo {
            op: crate::VolumeOp::Read { len, .. },
            ..
        } => *len as usize,
        _ => 0,
    }
}

/// Proves the member on `tcp` (or, unauthenticated, takes it as it is).
async fn open(
    tcp: TcpStream,
    auth: &PeerAuth,
) -> Result<(MemberStream, Option<shoal_tls::Member>), String> {
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    match auth {
        PeerAuth::Members(sec) => {
            let (s, m) = sec.accept(tcp).await.map_err(|e| e.to_string())?;
            tracing::debug!(node = m.node, "peer connection proven");
            Ok((s, Some(m)))
        }
        PeerAuth::Unauthenticated => Ok((MemberStream::Plain(tcp), None)),
    }
}

/// Serves a proven connection: a bare TCP stream is split without a lock.
async fn run<H: Handler>(stream: MemberStream, h: Arc<H>, b: Budgets) -> std::io::Result<()> {
    match stream {
        MemberStream::Plain(t) => {
            let (rd, wr) = t.into_split();
            connection(rd, wr, h, b).await
        }
        MemberStream::Tls(t) => {
            let (rd, wr) = tokio::io::split(t);
            connection(rd, wr, h, b).await
        }
    }
}

async fn connection<R, W, H>(rd: R, wr: W, handler: Arc<H>, budgets: Budgets) -> std::io::Result<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
    H: Handler,
{
    // Buffered: a small frame (header, body) arrives in one read call.
    let mut rd = tokio::io::BufReader::with_capacity(crate::READ_BUFFER, rd);
    let (tx, mut rx) =
        mpsc::channel::<(u64, Response, Bytes, Held)>(MAX_REQUESTS_IN_FLIGHT_PER_CONNECTION);
    let writer = tokio::spawn(async move {
        let mut w = BufWriter::with_capacity(256 << 10, wr);
        while let Some(first) = rx.recv().await {
            // The replies of one group commit are woken together, and the
            // runtime runs a task it just woke first: without this yield the
            // writer would run after the first reply and send each reply in
            // its own system call. After it, the whole group goes in one.
            tokio::task::yield_now().await;
            let mut next = Some(first);
            while let Some((id, resp, payload, held)) = next.take() {
                let body = match postcard::to_stdvec(&resp) {
                    Ok(b) => b,
                    Err(_) => return,
                };
                let h = Header {
                    flags: FLAG_REPLY,
                    id,
                    body_len: body.len() as u32,
                    payload_len: payload.len() as u32,
                };
                if w.write_all(&h.encode()).await.is_err()
                    || w.write_all(&body).await.is_err()
                    || w.write_all(&payload).await.is_err()
                {
                    return;
                }
                // Its bytes are in the socket's buffer or the writer's.
                drop(held);
                next = rx.try_recv().ok();
            }
            if w.flush().await.is_err() {
                return;
            }
        }
    });
    let requests = Arc::new(Semaphore::new(MAX_REQUESTS_IN_FLIGHT_PER_CONNECTION));
    let bytes = Arc::new(Semaphore::new(units(
        MAX_BYTES_IN_FLIGHT_PER_CONNECTION_MIB << 20,
    )));
    let res = async {
        loop {
            let mut hb = [0u8; HEADER_LEN];
            rd.read_exact(&mut hb).await?;
            let h = Header::decode(&hb)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            // Bounded by MAX_BODY (checked by decode); grows as it arrives.
            let body = crate::read_payload(&mut rd, h.body_len as usize).await?;
            let req = postcard::from_bytes::<Request>(&body);
            let want = h.payload_len as usize + req.as_ref().map_or(0, reply_bytes);
            let held = hold(&requests, &bytes, &budgets.node_bytes, want).await?;
            let payload = crate::read_payload(&mut rd, h.payload_len as usize).await?;
            let fut = match req {
                Ok(req) => handler.handle(req, payload),
                Err(e) => {
                    let msg = format!("undecodable request: {e}");
                    Box::pin(
                        async move { (Response::Err(RemoteError::BadRequest(msg)), Bytes::new()) },
                    )
                }
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let (resp, payload) = fut.await;
                let _ = tx.send((h.id, resp, payload, held)).await;
            });
        }
    }
    .await;
    drop(tx);
    let _ = writer.await;
    res
}

/// Takes a request's share of the connection's and the node's budgets,
/// waiting (and so not reading the connection) until they have room.
async fn hold(
    requests: &Arc<Semaphore>,
    bytes: &Arc<Semaphore>,
    node_bytes: &Arc<Semaphore>,
    want: usize,
) -> std::io::Result<Held> {
    let closed = |_| std::io::Error::other("budget closed");
    // One frame may be as large as the whole connection budget allows.
    let n = units(want).min(units(MAX_BYTES_IN_FLIGHT_PER_CONNECTION_MIB << 20)) as u32;
    Ok(Held {
        _requests: requests.clone().acquire_owned().await.map_err(closed)?,
        _bytes: bytes.clone().acquire_many_owned(n).await.map_err(closed)?,
        _node_bytes: node_bytes
            .clone()
            .acquire_many_owned(n)
            .await
            .map_err(closed)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Peer;
    use std::time::Duration;

    struct Echo;
    impl Handler for Echo {
        fn handle(&self, req: Request, payload: Bytes) -> Reply {
            Box::pin(async move {
                match req {
                    Request::Ping => (Response::Ok, Bytes::new()),
                    Request::Write { .. } => (Response::Data, payload),
                    _ => (
                        Response::Err(RemoteError::BadRequest("no".into())),
                        Bytes::new(),
                    ),
                }
            })
        }
    }

    #[tokio::test]
    async fn call_round_trip_and_bad_frames_close_one_connection() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(serve(l, Arc::new(Echo), PeerAuth::Unauthenticated));
        let p = Peer::connect(&addr, Duration::from_secs(1), &PeerAuth::Unauthenticated)
            .await
            .unwrap();
        let t = Duration::from_secs(2);
        assert_eq!(
            p.call(&Request::Ping, Bytes::new(), t).await.unwrap().0,
            Response::Ok
        );
        let data = Bytes::from(vec![7u8; 100_000]);
        let w = Request::Write {
            component: 1,
            generation: 1,
            offset: 0,
            seq: 1,
        };
        let pend: Vec<_> = (0..50).map(|_| p.send(&w, data.clone()).unwrap()).collect();
        for r in pend {
            assert_eq!(r.wait(t).await.unwrap().1, data);
        }
        let e = p
            .call(&Request::DeleteComponent { component: 1 }, Bytes::new(), t)
            .await;
        assert!(matches!(
            e,
            Err(crate::RpcError::Remote(RemoteError::BadRequest(_)))
        ));

        // Garbage on another connection: that connection closes, the first keeps working.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(&[0xffu8; 64]).await.unwrap();
        let mut buf = [0u8; 1];
        assert_eq!(s.read(&mut buf).await.unwrap(), 0);
        assert_eq!(
            p.call(&Request::Ping, Bytes::new(), t).await.unwrap().0,
            Response::Ok
        );
    }

    /// A peer that sends requests and never reads the replies stops being
    /// read once its budget is held: the node keeps at most
    /// MAX_BYTES_IN_FLIGHT_PER_CONNECTION_MIB of it (plus what the
    /// sockets buffer), however much it sends.
    #[tokio::test]
    async fn a_peer_that_does_not_read_replies_stops_being_read() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, Arc::new(Echo), PeerAuth::Unauthenticated));
        let mut s = TcpStream::connect(addr).await.unwrap();
        let payload = vec![7u8; 1 << 20];
        let mut sent_mib = 0usize;
        for id in 0..400u64 {
            let req = Request::Write {
                component: 1,
                generation: 1,
                offset: 0,
                seq: id,
            };
            let body = postcard::to_stdvec(&req).unwrap();
            let h = Header {
                flags: 0,
                id,
                body_len: body.len() as u32,
                payload_len: payload.len() as u32,
            };
            let mut frame = h.encode().to_vec();
            frame.extend_from_slice(&body);
            frame.extend_from_slice(&payload);
            let sent = tokio::time::timeout(Duration::from_secs(2), s.write_all(&frame)).await;
            if sent.is_err() {
                break;
            }
            sent_mib += 1;
        }
        // The echoed replies (1 MiB each) are held unread: the server
        // stopped reading near its budget, not at the 400 MiB sent.
        assert!(
            sent_mib < MAX_BYTES_IN_FLIGHT_PER_CONNECTION_MIB + 32,
            "{sent_mib} MiB accepted"
        );
        assert!(sent_mib >= 16, "{sent_mib} MiB accepted");
        // Another connection is still served.
        let p = Peer::connect(
            &addr.to_string(),
            Duration::from_secs(1),
            &PeerAuth::Unauthenticated,
        )
        .await
        .unwrap();
        let r = p
            .call(&Request::Ping, Bytes::new(), Duration::from_secs(2))
            .await;
        assert_eq!(r.unwrap().0, Response::Ok);
    }
}
