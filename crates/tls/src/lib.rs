//! # shoal-tls: who belongs to the cluster, proven on every connection
//!
//! Owns the cluster's certificate authority, the certificates it issues
//! (one per node, one per NBD client), the files a node keeps them in
//! (`DATA/tls/`), the rustls configurations built from them, and the
//! opening handshake of a connection between members (mutual TLS, then
//! either TLS for the rest of the connection or, when the data path is not
//! to be encrypted, the bare TCP stream the handshake authenticated).
//!
//! Knows nothing of what travels on a connection and never reads the
//! directory: the caller says which certificates are revoked.
//!
//! Identity: a node's certificate names it `node-<id>` (its common name)
//! and carries the DNS name [`MEMBER_NAME`] (every member's, so a member
//! is checked as "signed by this cluster's CA and a node" whatever
//! address it was reached on) and the node's IP addresses (so NBD clients
//! can check the host they dialled). An NBD client's certificate is
//! `client-<name>` and never passes as a node.

mod ca;
mod creds;
mod member;
mod verify;

pub use ca::{issue, new_ca, CaMaterial, KeyRequest, Subject};
pub use creds::{
    fingerprint_pem, join_client_config, load_ca, save_ca_key, ClientAuth, ClientCredentials,
    NodeCredentials, Revoked, CA_FILE, CA_KEY_FILE, CERT_FILE, KEY_FILE,
};
pub use member::{
    admitted, fingerprint, member_of, until_revoked, Admit, Member, MemberStream, PeerSecurity,
    HANDSHAKE_TIMEOUT_MS, READMIT_CHECK_MS,
};
pub use verify::{JoinPin, MEMBER_NAME};

/// Why a certificate could not be made or a connection not be proven.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("certificate: {0}")]
    Cert(String),
    #[error("cannot read or write {path}: {source}")]
    File {
        path: String,
        source: std::io::Error,
    },
    #[error("handshake: {0}")]
    Handshake(String),
    #[error("not a member of this cluster: {0}")]
    NotMember(String),
    #[error("no handshake within {HANDSHAKE_TIMEOUT_MS} ms")]
    Timeout,
}

impl From<rcgen::Error> for TlsError {
    fn from(e: rcgen::Error) -> Self {
        TlsError::Cert(e.to_string())
    }
}

impl From<rustls::Error> for TlsError {
    fn from(e: rustls::Error) -> Self {
        TlsError::Handshake(e.to_string())
    }
}

/// The one crypto provider Shoal uses (ring: no C++ or cmake build).
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests;
