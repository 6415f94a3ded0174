//! A small hand-written NBD client and server harness for the integration tests.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;

use shoal_nbd::mem::MemExports;
use shoal_nbd::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

pub const MIB: usize = 1024 * 1024;

/// A running `serve` loop; dropping `stop` (or sending on it) shuts it down.
pub struct Server {
    pub addr: SocketAddr,
    pub exports: Arc<MemExports>,
    pub stop: Option<oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
}

pub async fn start(exports: MemExports) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let exports = Arc::new(exports);
    let (stop, rx) = oneshot::channel::<()>();
    let stopped = async move {
        let _ = rx.await;
    };
    let task = tokio::spawn(serve(listener, exports.clone(), stopped, NbdTls::Off));
    Server {
        addr,
        exports,
        stop: Some(stop),
        task,
    }
}

/// Default test server: exports "disk" (4 MiB) and "other" (1 MiB).
pub async fn start_default() -> Server {
    let mut ex = MemExports::new();
    ex.add("disk", 4 * MIB);
    ex.add("other", MIB);
    start(ex).await
}

pub struct Client {
    pub s: TcpStream,
    pub handshake_flags: u16,
}

impl Client {
    /// Connect and complete the initial greeting (client flags FIXED_NEWSTYLE | NO_ZEROES).
    pub async fn connect(addr: SocketAddr) -> Client {
        Self::connect_with_flags(addr, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).await
    }

    pub async fn connect_with_flags(addr: SocketAddr, client_flags: u32) -> Client {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut g = [0u8; GREETING_LEN];
        s.read_exact(&mut g).await.unwrap();
        let handshake_flags = decode_greeting(&g).unwrap();
        s.write_all(&client_flags.to_be_bytes()).await.unwrap();
        Client { s, handshake_flags }
    }

    pub async fn send_option(&mut self, option: u32, data: &[u8]) {
        let o = OptionRequest {
            option,
            data: bytes::Bytes::copy_from_slice(data),
        };
        self.s.write_all(&o.encode()).await.unwrap();
    }

    pub async fn read_opt_reply(&mut self) -> OptionReply {
        let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
        self.s.read_exact(&mut h).await.unwrap();
        let h = OptionReplyHeader::decode(&h).unwrap();
        assert!(h.len < 1 << 20, "absurd option reply length");
        let mut data = vec![0u8; h.len as usize];
        self.s.read_exact(&mut data).await.unwrap();
        OptionReply::new(h.option, h.reply_type, data)
    }

    pub async fn list(&mut self) -> Vec<String> {
        self.send_option(NBD_OPT_LIST, &[]).await;
        let mut names = Vec::new();
        loop {
            let r = self.read_opt_reply().await;
            assert_eq!(r.option, NBD_OPT_LIST);
            match r.reply_type {
                NBD_REP_SERVER => names.push(ServerEntry::decode(&r.data).unwrap().name),
                NBD_REP_ACK => return names,
                t => panic!("unexpected reply type {t:#x}"),
            }
        }
    }

    /// NBD_OPT_INFO or NBD_OPT_GO; Ok(infos) after ACK, Err(error reply).
    pub async fn info_or_go(
        &mut self,
        option: u32,
        name: &str,
        requests: &[u16],
    ) -> Result<Vec<Info>, OptionReply> {
        let req = InfoRequest {
            name: name.to_string(),
            requests: requests.to_vec(),
        };
        self.send_option(option, &req.encode()).await;
        let mut infos = Vec::new();
        loop {
            let r = self.read_opt_reply().await;
            assert_eq!(r.option, option);
            match r.reply_type {
                NBD_REP_INFO => infos.push(Info::decode(&r.data).unwrap()),
                NBD_REP_ACK => return Ok(infos),
                _ if r.is_error() => return Err(r),
                t => panic!("unexpected reply type {t:#x}"),
            }
        }
    }

    /// GO to `name`; returns (size, transmission flags).
    pub async fn go(&mut self, name: &str) -> (u64, u16) {
        let infos = self.info_or_go(NBD_OPT_GO, name, &[]).await.unwrap();
        infos
            .iter()
            .find_map(|i| match i {
                Info::Export { size, flags } => Some((*size, *flags)),
                _ => None,
            })
            .expect("NBD_INFO_EXPORT")
    }

    pub async fn send_request(&mut self, req: Request, payload: &[u8]) {
        let mut buf = req.encode().to_vec();
        buf.extend_from_slice(payload);
        self.s.write_all(&buf).await.unwrap();
    }

    pub async fn read_reply(&mut self) -> SimpleReply {
        let mut h = [0u8; SIMPLE_REPLY_LEN];
        self.s.read_exact(&mut h).await.unwrap();
        SimpleReply::decode(&h).unwrap()
    }

    pub async fn read_bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v).await.unwrap();
        v
    }

    /// Simple synchronous (one request at a time) commands.
    pub async fn cmd(&mut self, command: Command, flags: u16, offset: u64, len: u32) -> u32 {
        let handle = rand_handle();
        self.send_request(
            Request {
                flags,
                command,
                handle,
                offset,
                len,
            },
            &[],
        )
        .await;
        let r = self.read_reply().await;
        assert_eq!(r.handle, handle);
        r.error
    }

    pub async fn write(&mut self, offset: u64, data: &[u8], flags: u16) -> u32 {
        let handle = rand_handle();
        let req = Request {
            flags,
            command: Command::Write,
            handle,
            offset,
            len: data.len() as u32,
        };
        self.send_request(req, data).await;
        let r = self.read_reply().await;
        assert_eq!(r.handle, handle);
        r.error
    }

    pub async fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        let handle = rand_handle();
        let req = Request {
            flags: 0,
            command: Command::Read,
            handle,
            offset,
            len,
        };
        self.send_request(req, &[]).await;
        let r = self.read_reply().await;
        assert_eq!(r.handle, handle);
        if r.error != 0 {
            return Err(r.error);
        }
        Ok(self.read_bytes(len as usize).await)
    }

    pub async fn disconnect(mut self) {
        let req = Request {
            flags: 0,
            command: Command::Disc,
            handle: 0,
            offset: 0,
            len: 0,
        };
        self.send_request(req, &[]).await;
        self.expect_eof().await;
    }

    /// Assert the server closes the connection (no more bytes).
    pub async fn expect_eof(&mut self) {
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), self.s.read(&mut b))
            .await
            .expect("server did not close the connection")
            .unwrap_or(0);
        assert_eq!(n, 0, "expected EOF");
    }
}

pub fn rand_handle() -> u64 {
    rand::random()
}

/// Polls `cond` until it holds, at most `timeout`; panics with `what` and
/// the last state `cond` described (its `Err`) if it never does. (The
/// shape of the cluster tests' `wait_for`, for async tests.)
pub async fn wait_for<T>(
    what: &str,
    timeout: std::time::Duration,
    mut cond: impl FnMut() -> Result<T, String>,
) -> T {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pause = std::time::Duration::from_millis(5);
    loop {
        match cond() {
            Ok(v) => return v,
            Err(last) if tokio::time::Instant::now() > deadline => {
                panic!("{what}: not after {timeout:?} (last: {last})")
            }
            Err(_) => {}
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_millis(100));
    }
}

/// Waits until the server's exports are open `n` times (connections that
/// ended are gone from the count once the server saw them end).
pub async fn wait_open_handles(srv: &Server, n: usize) {
    wait_for(
        &format!("{n} open export handles"),
        std::time::Duration::from_secs(5),
        || match srv.exports.open_handles() {
            k if k == n => Ok(()),
            k => Err(format!("{k} open")),
        },
    )
    .await
}
