//! A node's credentials (`DATA/tls/`: the cluster CA, its certificate and
//! its key) and the rustls configurations made from them. Also the files
//! handed to an NBD client (`DATA/tls/client/`, in the layout libnbd's
//! `tls-certificates=DIR` and qemu's `tls-creds-x509` read).

use crate::verify::{roots, JoinPin, MemberVerifier};
use crate::{member_of, provider, TlsError};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ServerConfig};
use shoal_model::NodeId;
use std::path::Path;
use std::sync::Arc;

/// The cluster CA's certificate, in a node's and a client's folder.
pub const CA_FILE: &str = "ca-cert.pem";
/// A node's certificate.
pub const CERT_FILE: &str = "node-cert.pem";
/// A node's private key (mode 0600).
pub const KEY_FILE: &str = "node-key.pem";
/// The CA's private key, on the founding node only (mode 0600): kept
/// until the directory has recorded the CA, and as a second copy after.
pub const CA_KEY_FILE: &str = "ca-key.pem";

/// SHA-256 of a certificate given in PEM, hex.
pub fn fingerprint_pem(pem: &str) -> Result<String, TlsError> {
    Ok(crate::fingerprint(&cert_from_pem(pem)?))
}

pub(crate) fn cert_from_pem(pem: &str) -> Result<CertificateDer<'static>, TlsError> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| TlsError::Cert(format!("not a PEM certificate: {e}")))
}

fn key_from_pem(pem: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| TlsError::Cert(format!("not a PEM private key: {e}")))
}

/// Whether a client must show a certificate of this cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// Members only (the peer port).
    Required,
    /// Members, and strangers that may only ask to join (the API port).
    Optional,
}

/// What a node proves itself with.
pub struct NodeCredentials {
    /// The node its certificate names.
    pub node: NodeId,
    /// The cluster CA, PEM (what a joining node's pin is taken of).
    pub ca_pem: String,
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for NodeCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeCredentials(node {})", self.node)
    }
}

/// Writes `text` to `path` with mode 0600, through a temporary file and a
/// rename, so a crash leaves the old file or the new one.
fn write_private(path: &Path, text: &str) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |source| TlsError::File {
        path: path.display().to_string(),
        source,
    };
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(text.as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

fn make_dir(dir: &Path) -> Result<(), TlsError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| TlsError::File {
            path: dir.display().to_string(),
            source,
        })
}

fn read(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|source| TlsError::File {
        path: path.display().to_string(),
        source,
    })
}

impl NodeCredentials {
    /// Checks that the three PEM texts belong together: the certificate
    /// names a node and is signed by the CA.
    pub fn from_pem(ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self, TlsError> {
        let ca = cert_from_pem(ca_pem)?;
        let cert = cert_from_pem(cert_pem)?;
        let key = key_from_pem(key_pem)?;
        let node = member_of(&cert)?.node;
        let creds = NodeCredentials {
            node,
            ca_pem: ca_pem.to_string(),
            ca,
            cert,
            key,
        };
        // The certificate must chain to the CA: a member would refuse it.
        use rustls::client::danger::ServerCertVerifier;
        MemberVerifier::new(&creds.ca)?
            .verify_server_cert(
                &creds.cert,
                &[],
                &rustls::pki_types::ServerName::try_from("member.shoal")
                    .map_err(|e| TlsError::Cert(e.to_string()))?,
                &[],
                rustls::pki_types::UnixTime::now(),
            )
            .map_err(|e| TlsError::Cert(format!("the node certificate: {e}")))?;
        Ok(creds)
    }

    /// The node's credentials in `dir`, or `None` when it has none yet
    /// (no certificate file: a certificate is written last).
    pub fn load(dir: &Path) -> Result<Option<Self>, TlsError> {
        if !dir.join(CERT_FILE).exists() {
            return Ok(None);
        }
        let ca = read(&dir.join(CA_FILE))?;
        let cert = read(&dir.join(CERT_FILE))?;
        let key = read(&dir.join(KEY_FILE))?;
        Self::from_pem(&ca, &cert, &key).map(Some)
    }

    /// Checks and stores credentials in `dir` (0700; files 0600), the
    /// certificate last.
    pub fn save(dir: &Path, ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<Self, TlsError> {
        let creds = Self::from_pem(ca_pem, cert_pem, key_pem)?;
        make_dir(dir)?;
        write_private(&dir.join(KEY_FILE), key_pem)?;
        write_private(&dir.join(CA_FILE), ca_pem)?;
        write_private(&dir.join(CERT_FILE), cert_pem)?;
        Ok(creds)
    }

    /// SHA-256 of this node's certificate, hex: what revocation names.
    pub fn cert_sha256(&self) -> String {
        crate::fingerprint(&self.cert)
    }

    /// The pin of this node's cluster CA.
    pub fn pin(&self) -> JoinPin {
        JoinPin(crate::fingerprint(&self.ca))
    }

    /// A server configuration presenting this node (its certificate, then
    /// the CA, for joining nodes to pin), TLS 1.3, no session tickets (a
    /// member connection lives long; and nothing must follow the
    /// handshake on a connection that drops to plain TCP).
    pub fn server_config(&self, auth: ClientAuth) -> Result<Arc<ServerConfig>, TlsError> {
        let v = WebPkiClientVerifier::builder_with_provider(roots(&self.ca)?, provider());
        let v = match auth {
            ClientAuth::Required => v,
            ClientAuth::Optional => v.allow_unauthenticated(),
        };
        let v = v.build().map_err(|e| TlsError::Cert(e.to_string()))?;
        self.server_config_with(v)
    }

    /// [`NodeCredentials::server_config`] with the client verifier `v`.
    fn server_config_with(
        &self,
        v: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    ) -> Result<Arc<ServerConfig>, TlsError> {
        let mut c = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(v)
            .with_single_cert(
                vec![self.cert.clone(), self.ca.clone()],
                self.key.clone_key(),
            )?;
        c.send_tls13_tickets = 0;
        Ok(Arc::new(c))
    }

    /// A client configuration that proves this node and accepts any
    /// member of its cluster as the server.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, TlsError> {
        let mut c = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(MemberVerifier::new(&self.ca)?))
            .with_client_auth_cert(vec![self.cert.clone()], self.key.clone_key())?;
        c.resumption = rustls::client::Resumption::disabled();
        Ok(Arc::new(c))
    }
}

/// Stores the CA's certificate and key in `dir` (the founding node, before
/// its own credentials, so a crash never leaves credentials without the
/// CA that made them).
pub fn save_ca_key(dir: &Path, ca: &crate::CaMaterial) -> Result<(), TlsError> {
    make_dir(dir)?;
    write_private(&dir.join(CA_KEY_FILE), &ca.key_pem)?;
    write_private(&dir.join(CA_FILE), &ca.cert_pem)
}

/// The CA kept in `dir`, if this node founded the cluster.
pub fn load_ca(dir: &Path) -> Result<Option<crate::CaMaterial>, TlsError> {
    if !dir.join(CA_KEY_FILE).exists() {
        return Ok(None);
    }
    Ok(Some(crate::CaMaterial {
        cert_pem: read(&dir.join(CA_FILE))?,
        key_pem: read(&dir.join(CA_KEY_FILE))?,
    }))
}

/// A client configuration for a node that is joining: it shows no
/// certificate and accepts only a member of the pinned cluster. The flag
/// it answers is set once a server showed another CA (the token is for
/// another cluster, or someone impersonates this one): not worth a retry.
pub fn join_client_config(
    pin: &JoinPin,
) -> Result<(Arc<ClientConfig>, Arc<std::sync::atomic::AtomicBool>), TlsError> {
    let mismatch = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let c = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(pin.verifier(mismatch.clone()))
        .with_no_client_auth();
    Ok((Arc::new(c), mismatch))
}

/// The files an NBD client needs, in `DIR/` as libnbd and qemu read them:
/// `ca-cert.pem`, `client-cert.pem`, `client-key.pem` (0600).
pub struct ClientCredentials;

impl ClientCredentials {
    pub fn save(dir: &Path, ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<(), TlsError> {
        make_dir(dir)?;
        write_private(&dir.join("client-key.pem"), key_pem)?;
        write_private(&dir.join(CA_FILE), ca_pem)?;
        write_private(&dir.join("client-cert.pem"), cert_pem)
    }
}

/// Whether a certificate (its SHA-256, hex) is revoked; asked at every
/// handshake, so it follows the directory as it changes.
pub type Revoked = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// The CA's verifier, and then a refusal of revoked certificates.
#[derive(Debug)]
struct RevocableVerifier {
    inner: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    revoked: RevokedDebug,
}

/// [`Revoked`] in a struct that must be `Debug`.
struct RevokedDebug(Revoked);

impl std::fmt::Debug for RevokedDebug {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Revoked")
    }
}

impl rustls::server::danger::ClientCertVerifier for RevocableVerifier {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let ok = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if (self.revoked.0)(&crate::fingerprint(end_entity)) {
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::Revoked,
            ));
        }
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

impl NodeCredentials {
    /// A server configuration for NBD clients: a certificate of the
    /// cluster's CA is required, and one that `revoked` names is refused
    /// at the handshake.
    pub fn client_server_config(&self, revoked: Revoked) -> Result<Arc<ServerConfig>, TlsError> {
        let inner = WebPkiClientVerifier::builder_with_provider(roots(&self.ca)?, provider())
            .build()
            .map_err(|e| TlsError::Cert(e.to_string()))?;
        self.server_config_with(Arc::new(RevocableVerifier {
            inner,
            revoked: RevokedDebug(revoked),
        }))
    }
}
