//! Raft transport, client side: JSON over HTTPS (mutual TLS, the client
//! given in [`Transport`]) to the peers' `/raft/*` routes (served by
//! [`crate::Directory::router`]).

use crate::{Transport, TypeConfig};
use openraft::error::{
    Fatal, InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, ReplicationClosed,
    StreamingError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{AnyError, BasicNode, Snapshot, SnapshotMeta, Vote};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use shoal_model::NodeId;
use std::future::Future;
use std::time::Duration;

/// Timeout of an append-entries or vote request.
const RPC_TIMEOUT: Duration = Duration::from_secs(2);
/// Timeout of a full snapshot transfer.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(30);
/// Connect timeout of every request between directory members.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Body of `POST /raft/snapshot`. The snapshot bytes are JSON, hence UTF-8.
#[derive(Serialize, Deserialize)]
pub(crate) struct SnapshotRequest {
    pub vote: Vote<NodeId>,
    pub meta: SnapshotMeta<NodeId, BasicNode>,
    pub data: String,
}

/// Creates one [`Conn`] per peer.
pub(crate) struct Network {
    transport: Transport,
}

impl Network {
    pub(crate) fn new(transport: Transport) -> Self {
        Network { transport }
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Conn;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Conn {
        Conn {
            target,
            addr: node.addr.clone(),
            transport: self.transport.clone(),
        }
    }
}

/// A connection to one peer.
pub(crate) struct Conn {
    target: NodeId,
    addr: String,
    transport: Transport,
}

/// Failure to get an answer at all: unreachable peers make Raft back off.
enum SendError {
    Unreachable(Unreachable),
    Network(NetworkError),
}

impl Conn {
    async fn post<Q: Serialize, A: DeserializeOwned>(
        &self,
        path: &str,
        body: &Q,
        timeout: Duration,
    ) -> Result<A, SendError> {
        let url = format!("{}://{}{}", self.transport.scheme, self.addr, path);
        let resp = self
            .transport
            .client
            .post(&url)
            .timeout(timeout)
            .json(body)
            .send()
            .await
            .map_err(|e| {
                if e.is_connect() {
                    SendError::Unreachable(Unreachable::new(&e))
                } else {
                    SendError::Network(NetworkError::new(&e))
                }
            })?;
        if !resp.status().is_success() {
            let msg = format!("{url}: HTTP {}", resp.status());
            return Err(SendError::Network(NetworkError::new(&AnyError::error(msg))));
        }
        resp.json::<A>()
            .await
            .map_err(|e| SendError::Network(NetworkError::new(&e)))
    }
}

fn rpc_err<E: std::error::Error>(e: SendError) -> RPCError<NodeId, BasicNode, E> {
    match e {
        SendError::Unreachable(u) => RPCError::Unreachable(u),
        SendError::Network(n) => RPCError::Network(n),
    }
}

impl RaftNetwork<TypeConfig> for Conn {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let timeout = option.hard_ttl().min(RPC_TIMEOUT);
        let res: Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>> = self
            .post("/raft/append", &rpc, timeout)
            .await
            .map_err(rpc_err)?;
        res.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }

    async fn install_snapshot(
        &mut self,
        _rpc: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<NodeId>,
        RPCError<NodeId, BasicNode, RaftError<NodeId, InstallSnapshotError>>,
    > {
        // Snapshots travel whole through `full_snapshot`; openraft 0.9 does
        // not call this.
        Err(RPCError::Network(NetworkError::new(&AnyError::error(
            "chunked snapshot transfer is not supported; snapshots are sent whole",
        ))))
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, RPCError<NodeId, BasicNode, RaftError<NodeId>>> {
        let timeout = option.hard_ttl().min(RPC_TIMEOUT);
        let res: Result<VoteResponse<NodeId>, RaftError<NodeId>> = self
            .post("/raft/vote", &rpc, timeout)
            .await
            .map_err(rpc_err)?;
        res.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote<NodeId>,
        snapshot: Snapshot<TypeConfig>,
        cancel: impl Future<Output = ReplicationClosed> + Send + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<NodeId>, StreamingError<TypeConfig, Fatal<NodeId>>> {
        let data = String::from_utf8(snapshot.snapshot.into_inner())
            .map_err(|e| StreamingError::Network(NetworkError::new(&e)))?;
        let req = SnapshotRequest {
            vote,
            meta: snapshot.meta,
            data,
        };
        let send = self.post::<_, Result<SnapshotResponse<NodeId>, Fatal<NodeId>>>(
            "/raft/snapshot",
            &req,
            SNAPSHOT_TIMEOUT,
        );
        let res = tokio::select! {
            closed = cancel => return Err(StreamingError::Closed(closed)),
            res = send => res,
        };
        match res {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(fatal)) => Err(StreamingError::RemoteError(RemoteError::new(
                self.target,
                fatal,
            ))),
            Err(SendError::Unreachable(u)) => Err(StreamingError::Unreachable(u)),
            Err(SendError::Network(n)) => Err(StreamingError::Network(n)),
        }
    }
}
