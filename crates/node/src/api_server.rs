//! The API port: one listener, three kinds of caller, told apart by the
//! first byte a connection sends.
//!
//! - Plain HTTP: the REST API for people and tools, each call with an API
//!   token ([`crate::auth`]); no route between nodes is served there.
//! - TLS with a member's certificate: the routes nodes call on each other
//!   (the directory's Raft and join routes, heartbeats), each request
//!   carrying the proven [`Caller`].
//! - TLS without a certificate: only `POST /v1/join`, where a new node
//!   shows its join token for a certificate.
//!
//! Bounded: [`MAX_API_CONNECTIONS`] at once, [`MAX_API_CONNECTIONS_PER_ADDRESS`]
//! from one address; a connection must show its
//! first byte and finish its handshake within `HANDSHAKE_TIMEOUT_MS`, and
//! send each request's headers within [`API_HEADER_READ_TIMEOUT_S`].

use axum::Extension;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use shoal_directory::Caller;
use shoal_tls::{Admit, HANDSHAKE_TIMEOUT_MS};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Connections the API port serves at once: people, tools, and every other
/// node's few; past this, a new connection is closed at once, so a flood
/// cannot use up the node's descriptors.
pub const MAX_API_CONNECTIONS: usize = 1024;

/// API connections from one address at once: a person, a tool or another
/// node needs a few; a host that opens more is refused, so it cannot take
/// every slot of the port.
pub const MAX_API_CONNECTIONS_PER_ADDRESS: usize = 128;

/// Time a connection has to send a request's headers once it is idle or
/// open, in seconds: a client that opens and says nothing loses its slot.
pub const API_HEADER_READ_TIMEOUT_S: u64 = 10;

/// First byte of a TLS connection (a handshake record).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Pause after a failed `accept` before the next, in milliseconds.
const ACCEPT_RETRY_MS: u64 = 50;

/// The three routers of the port.
pub struct ApiRouters {
    pub plain: axum::Router,
    pub members: axum::Router,
    pub joining: axum::Router,
}

/// What the port proves members with.
pub struct ApiTls {
    pub server: Arc<rustls::ServerConfig>,
    pub admit: Admit,
}

/// Serves the port for as long as the node runs.
pub async fn serve(listener: TcpListener, routers: ApiRouters, tls: ApiTls) -> std::io::Result<()> {
    let (routers, tls) = (Arc::new(routers), Arc::new(tls));
    let slots = Arc::new(Semaphore::new(MAX_API_CONNECTIONS));
    let per_address = shoal_rpc::PerAddress::new(MAX_API_CONNECTIONS_PER_ADDRESS);
    loop {
        let (stream, from) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "API accept failed");
                tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(%from, "API connection refused: {MAX_API_CONNECTIONS} already open");
            continue;
        };
        let Some(held) = per_address.take(from.ip()) else {
            tracing::warn!(
                %from,
                "API connection refused: {MAX_API_CONNECTIONS_PER_ADDRESS} already open from its address"
            );
            continue;
        };
        let (routers, tls) = (routers.clone(), tls.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(stream, &routers, &tls).await {
                tracing::debug!(%from, "API connection closed: {e}");
            }
            drop((slot, held));
        });
    }
}

async fn connection(tcp: TcpStream, routers: &ApiRouters, tls: &ApiTls) -> Result<(), String> {
    let handshake = Duration::from_millis(HANDSHAKE_TIMEOUT_MS);
    let mut first = [0u8; 1];
    let n = tokio::time::timeout(handshake, tcp.peek(&mut first))
        .await
        .map_err(|_| "no first byte in time".to_string())?
        .map_err(|e| e.to_string())?;
    if n == 0 {
        return Ok(());
    }
    if first[0] != TLS_HANDSHAKE_RECORD {
        return http(tcp, routers.plain.clone()).await;
    }
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
    let stream = tokio::time::timeout(handshake, acceptor.accept(tcp))
        .await
        .map_err(|_| "no TLS handshake in time".to_string())?
        .map_err(|e| format!("TLS handshake: {e}"))?;
    let certs = stream.get_ref().1.peer_certificates();
    if certs.is_none() {
        return http(stream, routers.joining.clone()).await;
    }
    let m = shoal_tls::admitted(certs, &tls.admit).map_err(|e| e.to_string())?;
    let router = routers
        .members
        .clone()
        .layer(Extension(Caller::Node(m.node)));
    // Served until the member's certificate is revoked.
    tokio::select! {
        r = http(stream, router) => r,
        () = shoal_tls::until_revoked(&tls.admit, &m) => Err("certificate revoked".into()),
    }
}

/// Serves HTTP/1.1 on `io` with `router`.
async fn http<S>(io: S, router: axum::Router) -> Result<(), String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(API_HEADER_READ_TIMEOUT_S))
        .serve_connection(TokioIo::new(io), TowerToHyperService::new(router))
        .await
        .map_err(|e| e.to_string())
}
