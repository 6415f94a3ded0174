//! Client side: one multiplexed TCP connection to a peer.
//!
//! [`Peer::send`] queues the frame synchronously, so frames leave in the
//! order `send` was called: an owner that calls `send` on every replica in
//! the same order gets the same apply order everywhere.

use crate::frame::{Header, HEADER_LEN};
use crate::{Handler, PeerAuth, Request, Response, RpcError};
use bytes::Bytes;
use shoal_tls::MemberStream;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

type Waiters = Arc<Mutex<HashMap<u64, oneshot::Sender<(Response, Bytes)>>>>;

/// A connection to one peer. Cheap to share behind an `Arc`.
pub struct Peer {
    addr: String,
    link: Link,
    waiters: Waiters,
    next_id: AtomicU64,
    closed: Arc<AtomicBool>,
}

enum Link {
    /// A TCP connection: frames go through the writer task.
    Tcp(mpsc::UnboundedSender<(Header, Vec<u8>, Bytes)>),
    /// The peer is this process: requests go straight to its handler, in
    /// call order, without a socket or a copy.
    Local(Arc<dyn Handler>),
}

/// Handlers of this process by the address they serve, so that a node
/// talking to itself skips the network.
static LOCAL: OnceLock<Mutex<HashMap<String, Arc<dyn Handler>>>> = OnceLock::new();

/// Declares that `addr` is served by `handler` in this process: later
/// [`Peer::connect`] calls to `addr` get an in-process link.
pub fn register_local(addr: &str, handler: Arc<dyn Handler>) {
    let m = LOCAL.get_or_init(Default::default);
    if let Ok(mut m) = m.lock() {
        m.insert(addr.to_string(), handler);
    }
}

fn local_handler(addr: &str) -> Option<Arc<dyn Handler>> {
    LOCAL.get()?.lock().ok()?.get(addr).cloned()
}

/// A reply that will arrive.
pub struct PendingReply {
    from: From,
}

enum From {
    /// A frame from the connection's reader task.
    Remote {
        rx: oneshot::Receiver<(Response, Bytes)>,
        id: u64,
        waiters: Waiters,
    },
    /// The rest of a local handler's work, run by whoever waits for it:
    /// no task and no channel of its own. `None` once taken.
    Local(Option<crate::server::Reply>),
}

impl Drop for PendingReply {
    /// A local request nobody waits for still runs to its end, as one sent
    /// over a connection does.
    fn drop(&mut self) {
        if let From::Local(fut) = &mut self.from {
            if let (Some(fut), Ok(rt)) = (fut.take(), tokio::runtime::Handle::try_current()) {
                rt.spawn(fut);
            }
        }
    }
}

impl PendingReply {
    /// Waits for the reply. A remote error becomes [`RpcError::Remote`].
    pub async fn wait(mut self, timeout: Duration) -> Result<(Response, Bytes), RpcError> {
        let r = match &mut self.from {
            From::Remote { rx, .. } => tokio::time::timeout(timeout, rx).await,
            From::Local(fut) => {
                let Some(fut) = fut.take() else {
                    return Err(RpcError::Closed);
                };
                tokio::time::timeout(timeout, fut).await.map(Ok)
            }
        };
        match r {
            Ok(Ok((Response::Err(e), _))) => Err(RpcError::Remote(e)),
            Ok(Ok(v)) => Ok(v),
            Ok(Err(_)) => Err(RpcError::Closed),
            Err(_) => {
                if let From::Remote { id, waiters, .. } = &self.from {
                    if let Ok(mut w) = waiters.lock() {
                        w.remove(id);
                    }
                }
                Err(RpcError::Timeout(timeout))
            }
        }
    }
}

impl Peer {
    /// Connects within `timeout` (TCP, then the member handshake).
    pub async fn connect(addr: &str, timeout: Duration, auth: &PeerAuth) -> Result<Peer, RpcError> {
        if let Some(h) = local_handler(addr) {
            return Ok(Peer {
                addr: addr.to_string(),
                link: Link::Local(h),
                waiters: Arc::new(Mutex::new(HashMap::new())),
                next_id: AtomicU64::new(1),
                closed: Arc::new(AtomicBool::new(false)),
            });
        }
        let cerr = |reason: String| RpcError::Connect {
            addr: addr.to_string(),
            reason,
        };
        let tcp = tokio::time::timeout(timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| cerr("timed out".into()))?
            .map_err(|e| cerr(e.to_string()))?;
        tcp.set_nodelay(true).map_err(|e| cerr(e.to_string()))?;
        let (stream, server) = match auth {
            PeerAuth::Members(sec) => {
                let (s, m) = sec.connect(tcp).await.map_err(|e| cerr(e.to_string()))?;
                (s, Some((sec.admit.clone(), m)))
            }
            PeerAuth::Unauthenticated => (MemberStream::Plain(tcp), None),
        };
        let waiters: Waiters = Arc::new(Mutex::new(HashMap::new()));
        let closed = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::unbounded_channel::<(Header, Vec<u8>, Bytes)>();
        match stream {
            MemberStream::Plain(t) => {
                let (rd, wr) = t.into_split();
                spawn_io(rd, wr, rx, waiters.clone(), closed.clone(), server);
            }
            MemberStream::Tls(t) => {
                let (rd, wr) = tokio::io::split(t);
                spawn_io(rd, wr, rx, waiters.clone(), closed.clone(), server);
            }
        }
        Ok(Peer {
            addr: addr.to_string(),
            link: Link::Tcp(tx),
            waiters,
            next_id: AtomicU64::new(1),
            closed,
        })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// True once the connection broke; make a new [`Peer`].
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
            || match &self.link {
                Link::Tcp(tx) => tx.is_closed(),
                Link::Local(_) => false,
            }
    }

    /// Queues a request now (preserving call order) and returns its reply.
    pub fn send(&self, req: &Request, payload: Bytes) -> Result<PendingReply, RpcError> {
        if self.is_closed() {
            return Err(RpcError::Closed);
        }
        let tx = match &self.link {
            Link::Tcp(tx) => tx,
            Link::Local(h) => {
                // The ordered part runs now, in call order, like a frame
                // arriving on a connection; the rest runs in the waiter.
                return Ok(PendingReply {
                    from: From::Local(Some(h.handle(req.clone(), payload))),
                });
            }
        };
        let body = postcard::to_stdvec(req).map_err(|e| RpcError::Protocol(e.to_string()))?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (otx, orx) = oneshot::channel();
        self.waiters
            .lock()
            .map_err(|_| RpcError::Closed)?
            .insert(id, otx);
        let h = Header {
            flags: 0,
            id,
            body_len: body.len() as u32,
            payload_len: payload.len() as u32,
        };
        tx.send((h, body, payload)).map_err(|_| RpcError::Closed)?;
        Ok(PendingReply {
            from: From::Remote {
                rx: orx,
                id,
                waiters: self.waiters.clone(),
            },
        })
    }

    /// Sends and waits.
    pub async fn call(
        &self,
        req: &Request,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<(Response, Bytes), RpcError> {
        self.send(req, payload)?.wait(timeout).await
    }
}

/// Starts a connection's writer and reader tasks. With a proven server,
/// the reader also ends (and so the connection) once the server's
/// certificate is revoked.
fn spawn_io<R, W>(
    rd: R,
    wr: W,
    rx: mpsc::UnboundedReceiver<(Header, Vec<u8>, Bytes)>,
    waiters: Waiters,
    closed: Arc<AtomicBool>,
    server: Option<(shoal_tls::Admit, shoal_tls::Member)>,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(write_frames(wr, rx, closed.clone()));
    let read = read_replies(rd, waiters.clone(), closed.clone());
    match server {
        None => {
            tokio::spawn(read);
        }
        Some((admit, m)) => {
            tokio::spawn(async move {
                tokio::select! {
                    () = read => {}
                    () = shoal_tls::until_revoked(&admit, &m) => {
                        closed.store(true, Ordering::SeqCst);
                        if let Ok(mut w) = waiters.lock() {
                            w.clear();
                        }
                    }
                }
            });
        }
    }
}

/// Writer: drains the queue, batching frames into one flush.
async fn write_frames<W: AsyncWrite + Unpin>(
    wr: W,
    mut rx: mpsc::UnboundedReceiver<(Header, Vec<u8>, Bytes)>,
    closed: Arc<AtomicBool>,
) {
    let mut w = BufWriter::with_capacity(256 << 10, wr);
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some((h, body, payload)) = next.take() {
            let ok = w.write_all(&h.encode()).await.is_ok()
                && w.write_all(&body).await.is_ok()
                && w.write_all(&payload).await.is_ok();
            if !ok {
                closed.store(true, Ordering::SeqCst);
                return;
            }
            next = rx.try_recv().ok();
        }
        if w.flush().await.is_err() {
            closed.store(true, Ordering::SeqCst);
            return;
        }
    }
}

/// Reader: matches replies to waiters; any framing error closes.
async fn read_replies<R: AsyncRead + Unpin>(rd: R, waiters: Waiters, closed: Arc<AtomicBool>) {
    // Buffered: a small frame (header, body) arrives in one read call.
    let mut rd = tokio::io::BufReader::with_capacity(crate::READ_BUFFER, rd);
    let r: Result<(), RpcError> = async {
        loop {
            let mut hb = [0u8; HEADER_LEN];
            rd.read_exact(&mut hb).await.map_err(|_| RpcError::Closed)?;
            let h = Header::decode(&hb).map_err(|e| RpcError::Protocol(e.to_string()))?;
            let body = crate::read_payload(&mut rd, h.body_len as usize)
                .await
                .map_err(|_| RpcError::Closed)?;
            let payload = crate::read_payload(&mut rd, h.payload_len as usize)
                .await
                .map_err(|_| RpcError::Closed)?;
            let resp: Response = postcard::from_bytes(&body)
                .map_err(|e| RpcError::Protocol(format!("bad reply body: {e}")))?;
            let waiter = waiters.lock().ok().and_then(|mut w| w.remove(&h.id));
            if let Some(tx) = waiter {
                let _ = tx.send((resp, payload));
            }
        }
    }
    .await;
    if let Err(e) = r {
        tracing::debug!("peer connection ended: {e}");
    }
    closed.store(true, Ordering::SeqCst);
    // Dropping the senders wakes every waiter with Closed.
    if let Ok(mut w) = waiters.lock() {
        w.clear();
    }
}
