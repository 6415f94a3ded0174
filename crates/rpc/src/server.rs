//! Server side: accept peers and run their requests through a [`Handler`].

use crate::frame::{Header, FLAG_REPLY, HEADER_LEN};
use crate::{RemoteError, Request, Response};
use bytes::Bytes;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

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

/// Accepts peers for as long as the node runs; each connection runs on
/// its own task, and a bad frame closes only that connection. A failed
/// `accept` (e.g. `EMFILE`) is logged and tried again: it never stops the
/// server, which would leave the node alive with a dead peer port.
pub async fn serve<H: Handler>(listener: TcpListener, handler: Arc<H>) -> std::io::Result<()> {
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "peer accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(ACCEPT_RETRY_MS)).await;
                continue;
            }
        };
        let h = handler.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(stream, h).await {
                tracing::debug!(%from, "peer connection closed: {e}");
            }
        });
    }
}

async fn connection<H: Handler>(stream: TcpStream, handler: Arc<H>) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let (rd, wr) = stream.into_split();
    // Buffered: a small frame (header, body) arrives in one read call.
    let mut rd = tokio::io::BufReader::with_capacity(crate::READ_BUFFER, rd);
    let (tx, mut rx) = mpsc::unbounded_channel::<(u64, Response, Bytes)>();
    let writer = tokio::spawn(async move {
        let mut w = BufWriter::with_capacity(256 << 10, wr);
        while let Some(first) = rx.recv().await {
            // The replies of one group commit are woken together, and the
            // runtime runs a task it just woke first: without this yield the
            // writer would run after the first reply and send each reply in
            // its own system call. After it, the whole group goes in one.
            tokio::task::yield_now().await;
            let mut next = Some(first);
            while let Some((id, resp, payload)) = next.take() {
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
                next = rx.try_recv().ok();
            }
            if w.flush().await.is_err() {
                return;
            }
        }
    });
    let res = async {
        loop {
            let mut hb = [0u8; HEADER_LEN];
            rd.read_exact(&mut hb).await?;
            let h = Header::decode(&hb)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
            let mut body = vec![0u8; h.body_len as usize];
            rd.read_exact(&mut body).await?;
            let payload = crate::read_payload(&mut rd, h.payload_len as usize).await?;
            let fut = match postcard::from_bytes::<Request>(&body) {
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
                let _ = tx.send((h.id, resp, payload));
            });
        }
    }
    .await;
    drop(tx);
    let _ = writer.await;
    res
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
        tokio::spawn(serve(l, Arc::new(Echo)));
        let p = Peer::connect(&addr, Duration::from_secs(1)).await.unwrap();
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
}
