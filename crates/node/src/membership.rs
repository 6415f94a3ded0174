//! A node's proof of membership (`DATA/tls/`): made with the cluster CA
//! when the node founds a cluster, obtained with a join token when it
//! joins one, loaded at every restart; and the other side of a join, the
//! certificate a member issues to a node that shows a valid join token.
//!
//! Owns the credentials' life and the join's checks; the certificates
//! themselves are `shoal_tls`'s.

use crate::NodeConfig;
use anyhow::{bail, ensure, Context, Result};
use shoal_api::{JoinCertAnswer, JoinCertRequest};
use shoal_directory::{Command, Directory};
use shoal_model::{CaRecord, JoinTokenText, NodeId, Role};
use shoal_tls::{CaMaterial, JoinPin, KeyRequest, NodeCredentials, Subject};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The node's folder of credentials, under its data folder.
pub const TLS_DIR: &str = "tls";

/// How long a joining node keeps asking a member for its certificate
/// while that member is starting, in seconds.
const JOIN_CERT_RETRY_S: u64 = 30;

/// Timeout of one certificate request, in seconds (a signature and one
/// directory write on the member).
const JOIN_CERT_TIMEOUT_S: u64 = 15;

/// Most addresses a node may have named in its certificate.
const MAX_CERT_ADDRS: usize = 16;

pub fn tls_dir(data_dir: &Path) -> PathBuf {
    data_dir.join(TLS_DIR)
}

/// The IP addresses a node serves on: named in its certificate so that
/// NBD clients can check the host they dialled.
pub fn node_ips(cfg: &NodeConfig) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = [&cfg.api_addr, &cfg.peer_addr, &cfg.nbd_addr]
        .iter()
        .filter_map(|a| a.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

/// The node's credentials: those it has, or new ones (founding: from a
/// new CA; joining: from the member at `cfg.join`, with the join token).
pub async fn obtain(cfg: &NodeConfig, cluster_id: &str, fresh: bool) -> Result<NodeCredentials> {
    let dir = tls_dir(&cfg.data_dir);
    if let Some(c) = NodeCredentials::load(&dir)? {
        ensure!(
            c.node == cfg.id,
            "{} holds the certificate of node {}, not of node {}",
            dir.display(),
            c.node,
            cfg.id
        );
        return Ok(c);
    }
    match (&cfg.join, fresh) {
        (None, true) => found(cfg, &dir, cluster_id),
        (Some(via), true) => join(cfg, &dir, via).await,
        (_, false) => bail!(
            "{} has no certificate: this node's data predates cluster certificates \
             (or lost them); start it with an empty data folder and a join token",
            dir.display()
        ),
    }
}

/// A new cluster: its CA (kept in `DATA/tls/ca-key.pem` until the
/// directory records it) and this node's certificate.
fn found(cfg: &NodeConfig, dir: &Path, cluster_id: &str) -> Result<NodeCredentials> {
    let ca = shoal_tls::new_ca(cluster_id)?;
    let req = KeyRequest::new()?;
    let subject = Subject::Node {
        id: cfg.id,
        addrs: node_ips(cfg),
    };
    let cert = shoal_tls::issue(&ca, cluster_id, &req.csr_pem, &subject)?;
    shoal_tls::save_ca_key(dir, &ca)?;
    Ok(NodeCredentials::save(
        dir,
        &ca.cert_pem,
        &cert,
        &req.key_pem,
    )?)
}

/// Asks the member at `via` for a certificate, showing the join token,
/// over TLS to a server whose CA the token pins.
async fn join(cfg: &NodeConfig, dir: &Path, via: &str) -> Result<NodeCredentials> {
    let text = cfg.join_token.as_deref().context(
        "joining a cluster needs a join token (--join-token or SHOAL_JOIN_TOKEN; \
         `shoal token create --join` on a member makes one)",
    )?;
    let token: JoinTokenText = text.parse()?;
    let pin = JoinPin(token.ca_sha256.clone());
    let (tls, mismatch) = shoal_tls::join_client_config(&pin)?;
    let client = reqwest::Client::builder()
        .use_preconfigured_tls((*tls).clone())
        .connect_timeout(shoal_directory::CONNECT_TIMEOUT)
        .timeout(Duration::from_secs(JOIN_CERT_TIMEOUT_S))
        .build()
        .context("building the join client")?;
    let req = KeyRequest::new()?;
    let body = JoinCertRequest {
        token: text.trim().to_string(),
        node: cfg.id,
        addrs: node_ips(cfg),
        csr_pem: req.csr_pem.clone(),
    };
    let answer = ask_for_cert(&client, via, &body, &mismatch).await?;
    ensure!(
        JoinPin::of_pem(&answer.ca_pem)? == pin,
        "{via} answered with a CA other than the one the join token names"
    );
    Ok(NodeCredentials::save(
        dir,
        &answer.ca_pem,
        &answer.cert_pem,
        &req.key_pem,
    )?)
}

/// POSTs the certificate request, retrying while the member cannot be
/// reached; a refusal is final.
async fn ask_for_cert(
    client: &reqwest::Client,
    via: &str,
    body: &JoinCertRequest,
    ca_mismatch: &std::sync::atomic::AtomicBool,
) -> Result<JoinCertAnswer> {
    let url = format!("https://{via}/v1/join");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(JOIN_CERT_RETRY_S);
    loop {
        match client.post(&url).json(body).send().await {
            Ok(r) if r.status().is_success() => {
                return r.json().await.with_context(|| format!("{url}: bad answer"));
            }
            Ok(r) => {
                let status = r.status();
                let text = r.text().await.unwrap_or_default();
                let msg = serde_json::from_str::<shoal_api::ErrorBody>(&text)
                    .map(|e| e.error)
                    .unwrap_or(text);
                bail!("{url} refused the join ({status}): {msg}");
            }
            Err(_) if ca_mismatch.load(std::sync::atomic::Ordering::SeqCst) => bail!(
                "{via} is not a member of the cluster this join token names \
                 (its CA differs from the token's): the join token was not sent"
            ),
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::debug!("{url}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => bail!("cannot reach {url}: {e}"),
        }
    }
}

/// What a member records at every start: the CA (on the founding node,
/// until the directory has it; the same CA again is accepted) and its own
/// certificate (so that revoking the node names it). Both idempotent.
pub async fn record(dir: &Directory, creds: &NodeCredentials, data_dir: &Path) -> Result<()> {
    if dir.state().ca.is_none() {
        if let Some(ca) = shoal_tls::load_ca(&tls_dir(data_dir))? {
            let ca = CaRecord {
                cert_pem: ca.cert_pem,
                key_pem: ca.key_pem,
            };
            crate::retry("recording the cluster CA", || {
                dir.propose(Command::SetClusterCa { ca: ca.clone() })
            })
            .await?;
        }
    }
    let cert_sha256 = creds.cert_sha256();
    let known = dir
        .state()
        .node_certs
        .get(&creds.node)
        .is_some_and(|c| c.contains(&cert_sha256));
    if !known {
        crate::retry("recording the node's certificate", || {
            dir.propose(Command::RecordNodeCert {
                node: creds.node,
                cert_sha256: cert_sha256.clone(),
            })
        })
        .await?;
    }
    Ok(())
}

/// Why a join was refused, with the HTTP status it answers.
#[derive(Debug, thiserror::Error)]
pub enum JoinRefused {
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Bad(String),
    #[error("{0}")]
    Unavailable(String),
}

pub(crate) fn now_unix_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Checks a join token: a join token the directory knows, not expired.
fn check_join_token(dir: &Directory, text: &str) -> Result<(), JoinRefused> {
    let t: JoinTokenText = text
        .parse()
        .map_err(|e: shoal_model::TokenError| JoinRefused::Unauthorized(e.to_string()))?;
    let state = dir.state();
    let known = state
        .tokens
        .get(&t.token.id)
        .filter(|k| t.token.proves(k) && k.role == Role::Join);
    match known {
        None => Err(JoinRefused::Unauthorized(format!(
            "join token {} is not valid here (unknown or revoked)",
            t.token.id
        ))),
        Some(k) if k.expired(now_unix_s()) => Err(JoinRefused::Unauthorized(format!(
            "join token {} has expired",
            t.token.id
        ))),
        Some(_) => Ok(()),
    }
}

/// Checks that `node` may join as new: it is neither a member nor a
/// registered node (a node that lost its data is revoked, then joins).
fn check_new_node(dir: &Directory, node: NodeId) -> Result<(), JoinRefused> {
    if node == 0 {
        return Err(JoinRefused::Bad("node ids start at 1".into()));
    }
    if dir.members().contains(&node) || dir.state().nodes.contains_key(&node) {
        return Err(JoinRefused::Conflict(format!(
            "node {node} is already a member of this cluster; a node that lost its \
             data joins under a new id (or after `shoal node revoke {node}`)"
        )));
    }
    Ok(())
}

/// Issues a joining node's certificate: checks the token and the node id,
/// signs, and records the certificate in the directory before answering.
pub async fn issue_for_join(
    dir: &Directory,
    req: &JoinCertRequest,
) -> Result<JoinCertAnswer, JoinRefused> {
    check_join_token(dir, &req.token)?;
    check_new_node(dir, req.node)?;
    if req.addrs.len() > MAX_CERT_ADDRS {
        return Err(JoinRefused::Bad(format!(
            "at most {MAX_CERT_ADDRS} addresses in a certificate"
        )));
    }
    let state = dir.state();
    let ca = state.ca.as_ref().ok_or_else(|| {
        JoinRefused::Unavailable("the cluster CA is not recorded yet; try again".into())
    })?;
    let material = CaMaterial {
        cert_pem: ca.cert_pem.clone(),
        key_pem: ca.key_pem.clone(),
    };
    let subject = Subject::Node {
        id: req.node,
        addrs: req.addrs.clone(),
    };
    let cert_pem = shoal_tls::issue(&material, &state.cluster_id, &req.csr_pem, &subject)
        .map_err(|e| JoinRefused::Bad(e.to_string()))?;
    let cert_sha256 = shoal_tls::fingerprint_pem(&cert_pem)
        .map_err(|e| JoinRefused::Unavailable(e.to_string()))?;
    dir.propose(Command::RecordNodeCert {
        node: req.node,
        cert_sha256,
    })
    .await
    .map_err(|e| JoinRefused::Unavailable(format!("recording the certificate: {e}")))?;
    tracing::info!(node = req.node, "issued a certificate to a joining node");
    Ok(JoinCertAnswer {
        cert_pem,
        ca_pem: material.cert_pem,
    })
}
