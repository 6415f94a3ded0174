//! Connection handling: accept loop, handshake / option haggling and the
//! pipelined transmission phase.

use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, Semaphore};
use tracing::{debug, info, warn};

use crate::codec::*;
use crate::tls::{self, Phase, TlsConn};
use crate::{Export, Exports, IoError, NbdError, NbdTls};

/// Requests being handled concurrently per connection.
pub(crate) const MAX_IN_FLIGHT: usize = 256;
/// Payload bytes (READ + WRITE) in flight per connection, in 4 KiB units.
const BYTE_UNIT: u32 = 4096;
const MAX_IN_FLIGHT_UNITS: u32 = (128 * 1024 * 1024) / BYTE_UNIT;
/// Option data we are willing to buffer (GO/INFO need 4 + 4096 + 2 + 2n).
const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Oversized option data we still skip (and answer TOO_BIG); beyond, we close.
const MAX_DISCARD_OPTION_LEN: u32 = 16 * 1024 * 1024;
/// Options accepted per connection before we consider it a DoS.
const MAX_OPTIONS: usize = 4096;
/// Connections one listener serves at once: past this a new connection is
/// closed at once, so a flood of idle connections cannot use up the node's
/// descriptors (the other ports keep theirs).
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections one client address may hold at once on a TCP listener: a
/// host runs a few clients per volume; one address cannot take them all.
pub const MAX_CONNECTIONS_PER_ADDRESS: usize = 128;
/// Seconds a client has from connecting to the end of option haggling,
/// a TLS handshake included: a real client takes milliseconds; one that
/// says nothing is closed.
pub const HANDSHAKE_TIMEOUT_S: u64 = 10;
/// Replies coalesced into one vectored write.
const MAX_BATCH_CHUNKS: usize = 64;
const MAX_BATCH_BYTES: usize = 4 * 1024 * 1024;

const HANDSHAKE_FLAGS: u16 = NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES;
const KNOWN_CLIENT_FLAGS: u32 = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;

/// A byte stream the protocol runs over: TCP, or a Unix socket for a
/// client on the server's own host (a hyperconverged node's virtual
/// machines), which skips the TCP stack on both sides.
pub trait Conn: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    type Reader: AsyncRead + Unpin + Send + 'static;
    type Writer: AsyncWrite + Unpin + Send + 'static;
    /// Owned halves, so that requests are read while replies are written.
    fn into_halves(self) -> (Self::Reader, Self::Writer);
    /// Socket options before the handshake.
    fn prepare(&self) {}
}

impl Conn for TcpStream {
    type Reader = tokio::net::tcp::OwnedReadHalf;
    type Writer = tokio::net::tcp::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        self.into_split()
    }
    fn prepare(&self) {
        // Replies are coalesced by the writer: Nagle would only delay them.
        if let Err(e) = self.set_nodelay(true) {
            debug!(error = %e, "set_nodelay failed");
        }
    }
}

impl Conn for UnixStream {
    type Reader = tokio::net::unix::OwnedReadHalf;
    type Writer = tokio::net::unix::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        self.into_split()
    }
}

/// Where connections come from: a TCP or a Unix-socket listener.
pub trait Listener: Send {
    type Conn: Conn;
    /// The next connection and a name of its peer for the logs.
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Conn, String)>> + Send;
}

impl Listener for TcpListener {
    type Conn = TcpStream;
    async fn accept(&self) -> io::Result<(TcpStream, String)> {
        let (s, peer) = TcpListener::accept(self).await?;
        Ok((s, peer.to_string()))
    }
}

impl Listener for UnixListener {
    type Conn = UnixStream;
    async fn accept(&self) -> io::Result<(UnixStream, String)> {
        let (s, _) = UnixListener::accept(self).await?;
        // Unix-socket clients are unnamed; the credentials say who it is.
        let peer = match s.peer_cred() {
            Ok(c) => format!("unix:pid={}", c.pid().unwrap_or(0)),
            Err(_) => "unix".to_string(),
        };
        Ok((s, peer))
    }
}

/// Accept loop: one task per connection; returns when `shutdown` resolves.
/// Errors of one connection (a failed TLS handshake too) are logged
/// (tracing) and never stop the loop. Connections already accepted keep
/// running after `serve` returns. `tls`: whether clients may, or must,
/// upgrade to TLS with NBD_OPT_STARTTLS.
pub async fn serve<L: Listener, E: Exports>(
    listener: L,
    exports: Arc<E>,
    shutdown: impl Future<Output = ()> + Send,
    tls: NbdTls,
) -> io::Result<()> {
    tokio::pin!(shutdown);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let per_address = PerAddress::default();
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        warn!(%peer, "nbd connection refused: {MAX_CONNECTIONS} already open");
                        continue;
                    };
                    let Some(held) = per_address.take(&peer) else {
                        warn!(%peer, "nbd connection refused: \
                            {MAX_CONNECTIONS_PER_ADDRESS} already open from its address");
                        continue;
                    };
                    let (exports, tls) = (exports.clone(), tls.clone());
                    tokio::spawn(async move {
                        let _held = (slot, held);
                        match serve_peer(stream, exports, tls, &peer).await {
                            Ok(()) => debug!(%peer, "nbd connection closed"),
                            Err(NbdError::ClientAborted) => debug!(%peer, "nbd client went away"),
                            Err(e) => warn!(%peer, error = %e, "nbd connection failed"),
                        }
                    });
                }
                Err(e) => {
                    // E.g. EMFILE: back off briefly instead of spinning.
                    warn!(error = %e, "nbd accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

/// Connections open per client address (TCP; Unix-socket clients are
/// local and authorised by the socket's permissions).
#[derive(Default, Clone)]
struct PerAddress(Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>);

/// One connection's place in [`PerAddress`]; given back when dropped.
struct AddressSlot(Option<(PerAddress, String)>);

impl PerAddress {
    /// A place for a connection from `peer` (`ip:port`, or `unix...`), or
    /// None when its address has [`MAX_CONNECTIONS_PER_ADDRESS`] already.
    fn take(&self, peer: &str) -> Option<AddressSlot> {
        if peer.starts_with("unix") {
            return Some(AddressSlot(None));
        }
        let addr = peer.rsplit_once(':').map_or(peer, |(a, _)| a).to_string();
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(addr.clone()).or_default();
        if *n >= MAX_CONNECTIONS_PER_ADDRESS {
            return None;
        }
        *n += 1;
        Some(AddressSlot(Some((self.clone(), addr))))
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        if let Some((per, addr)) = self.0.take() {
            let mut m = per.0.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = m.get_mut(&addr) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&addr);
                }
            }
        }
    }
}

/// Serve one already-accepted connection (used by serve and tests). The
/// handshake, a TLS handshake included, must end within
/// [`HANDSHAKE_TIMEOUT_S`].
pub async fn serve_connection<S: Conn, E: Exports>(
    stream: S,
    exports: Arc<E>,
    tls: NbdTls,
) -> Result<(), NbdError> {
    serve_peer(stream, exports, tls, "unnamed").await
}

/// [`serve_connection`] for a client `peer` names in the logs.
async fn serve_peer<S: Conn, E: Exports>(
    stream: S,
    exports: Arc<E>,
    tls: NbdTls,
    peer: &str,
) -> Result<(), NbdError> {
    stream.prepare();
    let haggle = negotiate(stream, &*exports, &tls, peer);
    let negotiated = tokio::time::timeout(Duration::from_secs(HANDSHAKE_TIMEOUT_S), haggle)
        .await
        .map_err(|_| {
            NbdError::Protocol(format!("no handshake within {HANDSHAKE_TIMEOUT_S} s"))
        })??;
    drop(exports);
    match negotiated {
        Negotiated::Plain(stream, export) => transmission(stream, Arc::new(export)).await,
        Negotiated::Tls(stream, export) => transmission(stream, Arc::new(export)).await,
        Negotiated::Aborted => Ok(()),
    }
}

/// How option haggling ended on a connection.
enum Negotiated<S, X> {
    /// An export is open; transmission runs on the plain stream.
    Plain(S, X),
    /// An export is open; transmission runs inside TLS.
    Tls(TlsConn<S>, X),
    /// The client sent NBD_OPT_ABORT.
    Aborted,
}

/// How one stretch of option haggling (before or inside TLS) ended.
enum Ended<X> {
    Go(X),
    Abort,
    /// NBD_REP_ACK was sent to NBD_OPT_STARTTLS: the TLS handshake is next.
    StartTls,
}

/// What option haggling knows of a connection, across the TLS upgrade.
struct Haggling {
    /// The client set NBD_FLAG_C_FIXED_NEWSTYLE.
    fixed_newstyle: bool,
    /// The client set NBD_FLAG_C_NO_ZEROES.
    no_zeroes: bool,
    /// Options the client may still send, before and inside TLS together.
    options_left: usize,
}

/// Greeting and option haggling; when the client sends NBD_OPT_STARTTLS
/// (and `tls` offers it), the TLS handshake, then haggling again inside
/// TLS from a clean state (nothing agreed before the upgrade carries over).
async fn negotiate<S: Conn, E: Exports>(
    mut stream: S,
    exports: &E,
    tls: &NbdTls,
    peer: &str,
) -> Result<Negotiated<S, E::Export>, NbdError> {
    let mut h = greet(&mut stream).await?;
    let phase = Phase::start(tls, h.fixed_newstyle)?;
    let creds = match haggle(&mut stream, exports, phase, &mut h).await? {
        Ended::Go(export) => return Ok(Negotiated::Plain(stream, export)),
        Ended::Abort => return Ok(Negotiated::Aborted),
        Ended::StartTls => tls.creds().ok_or_else(|| {
            NbdError::Protocol("NBD_OPT_STARTTLS accepted without TLS".to_string())
        })?,
    };
    let (mut stream, session) = tls::accept(stream, creds).await?;
    info!(%peer, %session, "nbd client upgraded to TLS");
    match haggle(&mut stream, exports, Phase::Upgraded, &mut h).await? {
        Ended::Go(export) => Ok(Negotiated::Tls(stream, export)),
        Ended::Abort => Ok(Negotiated::Aborted),
        Ended::StartTls => Err(NbdError::Protocol("a second TLS upgrade".to_string())),
    }
}

fn eof_to_abort(e: io::Error) -> NbdError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe => NbdError::ClientAborted,
        _ => NbdError::Io(e),
    }
}

fn transmission_flags<X: Export>(export: &X) -> u16 {
    let mut flags = NBD_FLAG_HAS_FLAGS
        | NBD_FLAG_SEND_FLUSH
        | NBD_FLAG_SEND_FUA
        | NBD_FLAG_SEND_TRIM
        | NBD_FLAG_SEND_WRITE_ZEROES;
    if export.multi_conn() {
        flags |= NBD_FLAG_CAN_MULTI_CONN;
    }
    flags
}

/// Writes `bytes` and flushes them: a TLS stream keeps what it could not
/// send at once until it is written to again or flushed.
async fn send<S: AsyncWrite + Unpin>(s: &mut S, bytes: &[u8]) -> io::Result<()> {
    s.write_all(bytes).await?;
    s.flush().await
}

async fn send_opt_reply<S: AsyncWrite + Unpin>(s: &mut S, reply: OptionReply) -> io::Result<()> {
    send(s, &reply.encode()).await
}

/// Read and throw away `n` bytes without allocating `n` bytes.
async fn discard<R: AsyncRead + Unpin>(r: &mut R, n: u64) -> io::Result<()> {
    let copied = tokio::io::copy(&mut r.take(n), &mut tokio::io::sink()).await?;
    if copied != n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Fixed newstyle greeting; answers what the client's flags say.
async fn greet<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S) -> Result<Haggling, NbdError> {
    send(stream, &encode_greeting(HANDSHAKE_FLAGS))
        .await
        .map_err(eof_to_abort)?;
    let client_flags = stream.read_u32().await.map_err(eof_to_abort)?;
    if client_flags & !KNOWN_CLIENT_FLAGS != 0 {
        return Err(NbdError::Protocol(format!(
            "unknown client flags {client_flags:#x}"
        )));
    }
    let fixed_newstyle = client_flags & NBD_FLAG_C_FIXED_NEWSTYLE != 0;
    if !fixed_newstyle {
        debug!("client did not set NBD_FLAG_C_FIXED_NEWSTYLE; continuing anyway");
    }
    Ok(Haggling {
        fixed_newstyle,
        no_zeroes: client_flags & NBD_FLAG_C_NO_ZEROES != 0,
        options_left: MAX_OPTIONS,
    })
}

/// Option haggling in one `phase`, until an export is opened, the client
/// aborts, or (before TLS) it asks for the TLS upgrade.
async fn haggle<S: AsyncRead + AsyncWrite + Unpin, E: Exports>(
    stream: &mut S,
    exports: &E,
    phase: Phase,
    h: &mut Haggling,
) -> Result<Ended<E::Export>, NbdError> {
    while h.options_left > 0 {
        h.options_left -= 1;
        let Some((option, data)) = read_option(stream, phase).await? else {
            continue;
        };
        if let Some(ended) = one_option(stream, exports, phase, h, option, data).await? {
            return Ok(ended);
        }
    }
    Err(NbdError::Protocol("too many options".to_string()))
}

/// The next option and its data; None when its data was too large, was
/// skipped and refused.
async fn read_option<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    phase: Phase,
) -> Result<Option<(u32, Vec<u8>)>, NbdError> {
    let mut hdr = [0u8; OPTION_HEADER_LEN];
    stream.read_exact(&mut hdr).await.map_err(eof_to_abort)?;
    let OptionHeader { option, len } = OptionHeader::decode(&hdr)
        .map_err(|e| NbdError::Protocol(format!("bad option header: {e}")))?;
    if len <= MAX_OPTION_LEN {
        // Bounded by MAX_OPTION_LEN.
        let mut data = vec![0u8; len as usize];
        stream.read_exact(&mut data).await.map_err(eof_to_abort)?;
        return Ok(Some((option, data)));
    }
    if option == NBD_OPT_EXPORT_NAME {
        return Err(NbdError::Protocol(format!(
            "NBD_OPT_EXPORT_NAME with {len} bytes of data"
        )));
    }
    let msg = format!("option data of {len} bytes is too large");
    let error = phase.refusal(option).unwrap_or(NBD_REP_ERR_TOO_BIG);
    send_opt_reply(stream, OptionReply::error(option, error, &msg)).await?;
    if len > MAX_DISCARD_OPTION_LEN {
        return Err(NbdError::Protocol(msg));
    }
    discard(stream, len as u64).await.map_err(eof_to_abort)?;
    Ok(None)
}

/// Answers one option; Some when haggling (in this phase) is over.
async fn one_option<S: AsyncRead + AsyncWrite + Unpin, E: Exports>(
    stream: &mut S,
    exports: &E,
    phase: Phase,
    h: &Haggling,
    option: u32,
    data: Vec<u8>,
) -> Result<Option<Ended<E::Export>>, NbdError> {
    if let Some(error) = phase.refusal(option) {
        if option == NBD_OPT_EXPORT_NAME {
            // It cannot be answered with an error: the spec says hang up.
            return Err(NbdError::Protocol(
                "NBD_OPT_EXPORT_NAME before NBD_OPT_STARTTLS; TLS is required".to_string(),
            ));
        }
        let msg = "TLS is required: send NBD_OPT_STARTTLS first";
        send_opt_reply(stream, OptionReply::error(option, error, msg)).await?;
        return Ok(None);
    }
    match option {
        NBD_OPT_EXPORT_NAME => Ok(Some(Ended::Go(
            export_name(stream, exports, data, h.no_zeroes).await?,
        ))),
        NBD_OPT_ABORT => {
            // The client may already have closed its end; ignore errors.
            let _ =
                send_opt_reply(stream, OptionReply::new(option, NBD_REP_ACK, Bytes::new())).await;
            let _ = stream.shutdown().await;
            Ok(Some(Ended::Abort))
        }
        NBD_OPT_STARTTLS => starttls(stream, phase, &data).await,
        NBD_OPT_LIST => list(stream, exports, &data).await.map(|()| None),
        NBD_OPT_INFO | NBD_OPT_GO => Ok(info_or_go(stream, exports, option, &data)
            .await?
            .map(Ended::Go)),
        _ => {
            // Includes STRUCTURED_REPLY, META_CONTEXT, EXTENDED_HEADERS.
            let reply = OptionReply::error(option, NBD_REP_ERR_UNSUP, "option not supported");
            send_opt_reply(stream, reply).await?;
            Ok(None)
        }
    }
}

/// NBD_OPT_STARTTLS: NBD_REP_ACK and the upgrade, or an error reply.
async fn starttls<S: AsyncWrite + Unpin, X>(
    stream: &mut S,
    phase: Phase,
    data: &[u8],
) -> Result<Option<Ended<X>>, NbdError> {
    match phase.starttls(data.len()) {
        Ok(()) => {
            let ack = OptionReply::new(NBD_OPT_STARTTLS, NBD_REP_ACK, Bytes::new());
            send_opt_reply(stream, ack).await?;
            Ok(Some(Ended::StartTls))
        }
        Err((error, msg)) => {
            send_opt_reply(stream, OptionReply::error(NBD_OPT_STARTTLS, error, msg)).await?;
            Ok(None)
        }
    }
}

/// NBD_OPT_EXPORT_NAME: the export, or an error that closes the connection
/// (the option has no error reply).
async fn export_name<S: AsyncWrite + Unpin, E: Exports>(
    stream: &mut S,
    exports: &E,
    data: Vec<u8>,
    no_zeroes: bool,
) -> Result<E::Export, NbdError> {
    let name = String::from_utf8(data)
        .map_err(|_| NbdError::Protocol("export name is not valid UTF-8".to_string()))?;
    match exports.open(&name).await {
        Ok(export) => {
            let reply = ExportNameReply {
                size: export.size(),
                flags: transmission_flags(&export),
            };
            send(stream, &reply.encode(no_zeroes)).await?;
            debug!(name = %name, "export opened via NBD_OPT_EXPORT_NAME");
            Ok(export)
        }
        Err(message) => Err(NbdError::ExportRejected { name, message }),
    }
}

/// NBD_OPT_LIST: one NBD_REP_SERVER per export, then NBD_REP_ACK.
async fn list<S: AsyncWrite + Unpin, E: Exports>(
    stream: &mut S,
    exports: &E,
    data: &[u8],
) -> Result<(), NbdError> {
    if !data.is_empty() {
        let msg = "NBD_OPT_LIST takes no data";
        let reply = OptionReply::error(NBD_OPT_LIST, NBD_REP_ERR_INVALID, msg);
        return Ok(send_opt_reply(stream, reply).await?);
    }
    let mut out = Vec::new();
    for name in exports.list().await {
        let entry = ServerEntry {
            name: clamp_string(&name).to_string(),
            details: String::new(),
        };
        out.extend_from_slice(
            &OptionReply::new(NBD_OPT_LIST, NBD_REP_SERVER, entry.encode()).encode(),
        );
    }
    out.extend_from_slice(&OptionReply::new(NBD_OPT_LIST, NBD_REP_ACK, Bytes::new()).encode());
    Ok(send(stream, &out).await?)
}

/// NBD_OPT_INFO / NBD_OPT_GO: the export's information; Some(export)
/// after a successful GO (an INFO's export is dropped here).
async fn info_or_go<S: AsyncWrite + Unpin, E: Exports>(
    stream: &mut S,
    exports: &E,
    option: u32,
    data: &[u8],
) -> Result<Option<E::Export>, NbdError> {
    let req = match InfoRequest::decode(data) {
        Ok(r) => r,
        Err(e) => {
            let msg = format!("malformed option data: {e}");
            send_opt_reply(
                stream,
                OptionReply::error(option, NBD_REP_ERR_INVALID, &msg),
            )
            .await?;
            return Ok(None);
        }
    };
    let export = match exports.open(&req.name).await {
        Ok(x) => x,
        Err(message) => {
            let reply = OptionReply::error(option, NBD_REP_ERR_UNKNOWN, &message);
            send_opt_reply(stream, reply).await?;
            return Ok(None);
        }
    };
    send(stream, &info_replies(option, &req, &export)).await?;
    if option == NBD_OPT_GO {
        debug!(name = %req.name, "export opened via NBD_OPT_GO");
        return Ok(Some(export));
    }
    Ok(None)
}

/// The NBD_REP_INFO replies to `req` and the closing NBD_REP_ACK.
fn info_replies<X: Export>(option: u32, req: &InfoRequest, export: &X) -> Vec<u8> {
    let mut infos = vec![Info::Export {
        size: export.size(),
        flags: transmission_flags(export),
    }];
    if req.requests.contains(&NBD_INFO_NAME) {
        infos.push(Info::Name(req.name.clone()));
    }
    infos.push(Info::BlockSize {
        min: export.min_block_size(),
        preferred: PREFERRED_BLOCK_SIZE,
        max: MAX_BLOCK_SIZE,
    });
    let mut out = Vec::new();
    for i in infos {
        out.extend_from_slice(&OptionReply::new(option, NBD_REP_INFO, i.encode()).encode());
    }
    out.extend_from_slice(&OptionReply::new(option, NBD_REP_ACK, Bytes::new()).encode());
    out
}

/// A request's answer as the writer task receives it: the writer polls it
/// (no task per request), and sends its reply once it is ready.
type Answer = Pin<Box<dyn Future<Output = Reply> + Send>>;

/// A request being served: ends it on the export, and gives back its
/// budget, when its answer is ready or dropped (the connection closing).
struct InFlight<X: Export> {
    export: Arc<X>,
    _request: tokio::sync::OwnedSemaphorePermit,
    _bytes: tokio::sync::OwnedSemaphorePermit,
}

impl<X: Export> Drop for InFlight<X> {
    fn drop(&mut self) {
        self.export.request_ended();
    }
}

/// An answer that is already known (a request refused before the export).
fn ready_answer(r: Reply) -> Answer {
    Box::pin(std::future::ready(r))
}

/// A reply queued for the writer task.
struct Reply {
    handle: u64,
    error: u32,
    data: Option<Bytes>,
}

impl Reply {
    fn err(handle: u64, error: u32) -> Self {
        Self {
            handle,
            error,
            data: None,
        }
    }
}

/// Validation outcome of a request header before touching the export.
fn check_request(req: &Request, size: u64) -> Result<(), u32> {
    let allowed_flags = match req.command {
        Command::WriteZeroes => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE,
        _ => NBD_CMD_FLAG_FUA,
    };
    if req.flags & !allowed_flags != 0 {
        return Err(NBD_EINVAL);
    }
    match req.command {
        Command::Flush => Ok(()),
        Command::Read | Command::Write | Command::Trim | Command::WriteZeroes => {
            if req.len == 0 {
                return Err(NBD_EINVAL);
            }
            let payload = matches!(req.command, Command::Read | Command::Write);
            if payload && req.len > MAX_BLOCK_SIZE {
                return Err(NBD_EINVAL);
            }
            let in_range = req
                .offset
                .checked_add(req.len as u64)
                .is_some_and(|end| end <= size);
            if !in_range {
                // proto.md: ENOSPC for writes past the end, EINVAL otherwise.
                return Err(match req.command {
                    Command::Write | Command::WriteZeroes => NBD_ENOSPC,
                    _ => NBD_EINVAL,
                });
            }
            Ok(())
        }
        _ => Err(NBD_EINVAL),
    }
}

async fn transmission<S: Conn, X: Export>(stream: S, export: Arc<X>) -> Result<(), NbdError> {
    let (read_half, write_half) = stream.into_halves();
    let mut reader = BufReader::with_capacity(256 * 1024, read_half);
    let (tx, rx) = mpsc::channel::<Answer>(MAX_IN_FLIGHT);
    let writer = tokio::spawn(writer_loop(write_half, rx));
    let requests = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let bytes_budget = Arc::new(Semaphore::new(MAX_IN_FLIGHT_UNITS as usize));
    let size = export.size();

    let read_result = reader_loop(&mut reader, &export, &tx, &requests, &bytes_budget, size).await;
    drop(tx);
    // Wait until every request finished (each releases its permits after
    // dropping its export handle), so the export is released when this
    // function returns.
    let _ = requests.acquire_many(MAX_IN_FLIGHT as u32).await;
    let write_result = writer.await;
    drop(export);
    read_result?;
    match write_result {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(eof_to_abort(e)),
        Err(join) => Err(NbdError::Io(io::Error::other(join.to_string()))),
    }
}

async fn reader_loop<X: Export, R: AsyncRead + Unpin>(
    reader: &mut R,
    export: &Arc<X>,
    tx: &mpsc::Sender<Answer>,
    requests: &Arc<Semaphore>,
    bytes_budget: &Arc<Semaphore>,
    size: u64,
) -> Result<(), NbdError> {
    loop {
        let mut hdr = [0u8; REQUEST_LEN];
        tokio::select! {
            biased;
            // The writer died (socket broken): stop reading.
            _ = tx.closed() => return Ok(()),
            r = reader.read_exact(&mut hdr) => { r.map_err(eof_to_abort)?; }
        }
        let req =
            Request::decode(&hdr).map_err(|e| NbdError::Protocol(format!("bad request: {e}")))?;

        if req.command == Command::Disc {
            debug!("NBD_CMD_DISC");
            return Ok(());
        }

        if let Err(error) = check_request(&req, size) {
            debug!(?req, error, "rejecting request");
            if req.command == Command::Write {
                // The payload still follows the header; skip it without
                // buffering it (it may be up to 4 GiB).
                discard(reader, req.len as u64)
                    .await
                    .map_err(eof_to_abort)?;
            }
            if tx
                .send(ready_answer(Reply::err(req.handle, error)))
                .await
                .is_err()
            {
                return Ok(());
            }
            continue;
        }

        let units = match req.command {
            Command::Read | Command::Write => req.len.div_ceil(BYTE_UNIT),
            _ => 0,
        };
        let (Ok(permit), Ok(byte_permit)) = (
            requests.clone().acquire_owned().await,
            bytes_budget.clone().acquire_many_owned(units).await,
        ) else {
            return Ok(());
        };

        let payload = if req.command == Command::Write {
            // len <= MAX_BLOCK_SIZE was checked above.
            read_payload(reader, req.len as usize)
                .await
                .map_err(eof_to_abort)?
        } else {
            Bytes::new()
        };

        export.request_started();
        let in_flight = InFlight {
            export: export.clone(),
            _request: permit,
            _bytes: byte_permit,
        };
        // Started here, in arrival order, before the next request is read.
        let answer = start_request(&**export, req, payload).map(move |reply| {
            drop(in_flight);
            reply
        });
        if tx.send(Box::pin(answer)).await.is_err() {
            return Ok(());
        }
    }
}

/// Starts one request on the export now; the future answers it.
fn start_request<X: Export>(
    export: &X,
    req: Request,
    payload: Bytes,
) -> impl Future<Output = Reply> + Send + 'static {
    let fua = req.flags & NBD_CMD_FLAG_FUA != 0;
    // Combinators, not `async` blocks: an `async` wrapper keeps the inner
    // future twice in its state, and these sit on every request's path.
    type Op = Pin<Box<dyn Future<Output = Result<Option<Bytes>, IoError>> + Send>>;
    let op: Op = match req.command {
        Command::Read => Box::pin(export.read(req.offset, req.len).map(|r| r.map(Some))),
        Command::Write => Box::pin(
            export
                .write(req.offset, payload, fua)
                .map(|r| r.map(|_| None)),
        ),
        Command::Flush => Box::pin(export.flush().map(|r| r.map(|_| None))),
        Command::Trim => Box::pin(
            export
                .trim(req.offset, req.len, fua)
                .map(|r| r.map(|_| None)),
        ),
        Command::WriteZeroes => {
            let may_trim = req.flags & NBD_CMD_FLAG_NO_HOLE == 0;
            Box::pin(
                export
                    .write_zeroes(req.offset, req.len, fua, may_trim)
                    .map(|r| r.map(|_| None)),
            )
        }
        _ => Box::pin(std::future::ready(Err(IoError::Invalid))),
    };
    op.map(move |r| answer(req, r))
}

/// The reply to `req` from its export's answer.
fn answer(req: Request, result: Result<Option<Bytes>, IoError>) -> Reply {
    let result = match (req.command, result) {
        (Command::Read, Ok(Some(data))) if data.len() == req.len as usize => {
            return Reply {
                handle: req.handle,
                error: NBD_OK,
                data: Some(data),
            }
        }
        (Command::Read, Ok(data)) => {
            warn!(
                expected = req.len,
                got = data.map_or(0, |d| d.len()),
                "export returned a short read"
            );
            Err(IoError::Io)
        }
        (_, r) => r.map(|_| ()),
    };
    Reply::err(
        req.handle,
        match result {
            Ok(()) => NBD_OK,
            Err(e) => e.to_nbd(),
        },
    )
}

/// Single writer: polls the answers of the requests in flight and sends
/// their replies in completion order, coalescing whatever is ready into one
/// vectored write (reply header and read payload together). Ends when the
/// reader is gone and every answer was sent.
async fn writer_loop<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::Receiver<Answer>,
) -> io::Result<()> {
    let mut chunks: Vec<Bytes> = Vec::with_capacity(MAX_BATCH_CHUNKS * 2);
    let mut pending: FuturesUnordered<Answer> = FuturesUnordered::new();
    let mut reading = true;
    loop {
        let first = tokio::select! {
            biased;
            Some(r) = pending.next(), if !pending.is_empty() => r,
            a = rx.recv(), if reading => {
                match a {
                    Some(a) => pending.push(a),
                    None => reading = false,
                }
                continue;
            }
            else => break,
        };
        // Let the other answers that are about to be ready join this one:
        // the tasks that complete them (an owner's loop, a replica's
        // connection) may be queued behind this one.
        tokio::task::yield_now().await;
        let mut total = push_reply(first, &mut chunks);
        while chunks.len() < MAX_BATCH_CHUNKS && total < MAX_BATCH_BYTES {
            while let Ok(a) = rx.try_recv() {
                pending.push(a);
            }
            match pending.next().now_or_never() {
                Some(Some(r)) => total += push_reply(r, &mut chunks),
                _ => break,
            }
        }
        write_all_vectored(&mut w, &chunks).await?;
        // A no-op on a socket; a TLS stream may hold back the batch's end.
        w.flush().await?;
        chunks.clear();
    }
    let _ = w.shutdown().await;
    Ok(())
}

/// Append a reply's header (and payload) to `chunks`; returns bytes added.
fn push_reply(r: Reply, chunks: &mut Vec<Bytes>) -> usize {
    let hdr = SimpleReply {
        error: r.error,
        handle: r.handle,
    }
    .encode();
    chunks.push(Bytes::copy_from_slice(&hdr));
    match r.data {
        Some(d) => {
            let n = hdr.len() + d.len();
            chunks.push(d);
            n
        }
        None => hdr.len(),
    }
}

async fn write_all_vectored<W: AsyncWrite + Unpin>(w: &mut W, chunks: &[Bytes]) -> io::Result<()> {
    let mut idx = 0;
    let mut off = 0;
    loop {
        while idx < chunks.len() && off == chunks[idx].len() {
            idx += 1;
            off = 0;
        }
        if idx == chunks.len() {
            return Ok(());
        }
        let slices: Vec<IoSlice<'_>> = chunks[idx..]
            .iter()
            .enumerate()
            .map(|(i, c)| IoSlice::new(if i == 0 { &c[off..] } else { &c[..] }))
            .collect();
        let mut n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let rem = chunks[idx].len() - off;
            if n >= rem {
                n -= rem;
                idx += 1;
                off = 0;
            } else {
                off += n;
                n = 0;
            }
        }
    }
}

/// Reads exactly `n` bytes into a fresh buffer, without zeroing it first.
async fn read_payload<R: AsyncRead + Unpin>(r: &mut R, n: usize) -> std::io::Result<Bytes> {
    let mut buf = BytesMut::with_capacity(n);
    while buf.len() < n {
        let want = n - buf.len();
        if (&mut *r).take(want as u64).read_buf(&mut buf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(buf.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemExports;

    async fn listen() -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut e = MemExports::new();
        e.add("d", 1 << 20);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopped = async move {
            let _ = stopped.await;
        };
        tokio::spawn(serve(l, Arc::new(e), stopped, NbdTls::Off));
        (addr, stop)
    }

    /// The server's greeting, or None if the connection was closed first.
    async fn greeting(s: &mut TcpStream) -> Option<[u8; 18]> {
        let mut g = [0u8; 18];
        s.read_exact(&mut g).await.ok().map(|_| g)
    }

    /// One address gets at most MAX_CONNECTIONS_PER_ADDRESS connections;
    /// one more is closed before the greeting, and a place frees when a
    /// connection closes.
    #[tokio::test]
    async fn one_address_cannot_take_every_connection() {
        let (addr, _stop) = listen().await;
        let mut open = Vec::new();
        for _ in 0..MAX_CONNECTIONS_PER_ADDRESS {
            let mut s = TcpStream::connect(addr).await.unwrap();
            assert!(greeting(&mut s).await.is_some());
            open.push(s);
        }
        let mut extra = TcpStream::connect(addr).await.unwrap();
        assert!(greeting(&mut extra).await.is_none(), "one too many");
        drop(open.pop());
        let mut again = None;
        for _ in 0..100 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            if greeting(&mut s).await.is_some() {
                again = Some(s);
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(again.is_some(), "the freed place is given again");
    }

    /// A client that connects and says nothing is closed once the
    /// handshake time is up.
    #[tokio::test(start_paused = true)]
    async fn a_silent_client_is_closed_after_the_handshake_timeout() {
        let (addr, _stop) = listen().await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        assert!(greeting(&mut s).await.is_some());
        let t0 = tokio::time::Instant::now();
        let mut buf = [0u8; 1];
        let n = s.read(&mut buf).await.unwrap_or(0);
        assert_eq!(n, 0, "closed, not answered");
        assert!(t0.elapsed() >= Duration::from_secs(HANDSHAKE_TIMEOUT_S));
    }
}
