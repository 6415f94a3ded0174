//! The cluster CA: made once when the cluster is founded; it signs every
//! node's certificate and every NBD client's, so "signed by this cluster's
//! CA" means "admitted by this cluster". Issuing ignores everything a
//! request asks for except its public key: the issuer alone decides the
//! name, the addresses and what the certificate may be used for.

use crate::verify::MEMBER_NAME;
use crate::TlsError;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use sha2::{Digest, Sha256};
use shoal_model::NodeId;
use std::net::IpAddr;

/// The CA's certificate and private key, PEM. The key signs certificates
/// for joining nodes, so every member keeps it (see `docs/security.md`).
#[derive(Clone, PartialEq, Eq)]
pub struct CaMaterial {
    pub cert_pem: String,
    pub key_pem: String,
}

impl std::fmt::Debug for CaMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.write_str("CaMaterial(..)")
    }
}

/// A new key and the request for a certificate over it: the key stays
/// with whoever made it, only the request travels.
pub struct KeyRequest {
    pub key_pem: String,
    pub csr_pem: String,
}

/// Whom a certificate is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// A node, with the IP addresses it serves on.
    Node { id: NodeId, addrs: Vec<IpAddr> },
    /// An NBD or API client, by a name of its holder's choosing.
    Client { name: String },
}

fn name(common: &str, cluster_id: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common);
    dn.push(DnType::OrganizationName, format!("shoal {cluster_id}"));
    dn
}

/// Makes the CA of a new cluster.
pub fn new_ca(cluster_id: &str) -> Result<CaMaterial, TlsError> {
    let key = KeyPair::generate()?;
    let mut p = CertificateParams::default();
    p.distinguished_name = name("shoal cluster CA", cluster_id);
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = p.self_signed(&key)?;
    Ok(CaMaterial {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

impl KeyRequest {
    /// A new key pair (ECDSA P-256) and a request signed with it.
    pub fn new() -> Result<KeyRequest, TlsError> {
        let key = KeyPair::generate()?;
        let csr = CertificateParams::default().serialize_request(&key)?;
        Ok(KeyRequest {
            key_pem: key.serialize_pem(),
            csr_pem: csr.pem()?,
        })
    }
}

/// The common name a subject's certificate carries.
pub(crate) fn common_name(subject: &Subject) -> String {
    match subject {
        Subject::Node { id, .. } => format!("node-{id}"),
        Subject::Client { name } => format!("client-{name}"),
    }
}

/// Signs a certificate for `subject` over the public key of `csr_pem`
/// (whose signature must hold). Answers the certificate, PEM.
pub fn issue(
    ca: &CaMaterial,
    cluster_id: &str,
    csr_pem: &str,
    subject: &Subject,
) -> Result<String, TlsError> {
    let ca_key = KeyPair::from_pem(&ca.key_pem)?;
    let issuer = Issuer::from_ca_cert_pem(&ca.cert_pem, ca_key)?;
    let csr = CertificateSigningRequestParams::from_pem(csr_pem)?;
    let mut p = CertificateParams::default();
    let cn = common_name(subject);
    p.distinguished_name = name(&cn, cluster_id);
    // Key encipherment too: GnuTLS (qemu's tls-creds-x509) refuses a
    // certificate whose key usage lacks it.
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    p.use_authority_key_identifier_extension = true;
    match subject {
        Subject::Node { addrs, .. } => {
            p.subject_alt_names = vec![SanType::DnsName(MEMBER_NAME.try_into()?)];
            p.subject_alt_names
                .extend(addrs.iter().map(|a| SanType::IpAddress(*a)));
            p.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
        }
        Subject::Client { .. } => {
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        }
    }
    // Distinct per key and subject; positive (top bit clear), 16 bytes.
    let mut h = Sha256::new();
    h.update(csr_pem.as_bytes());
    h.update(cn.as_bytes());
    let mut serial: [u8; 16] = h.finalize()[..16].try_into().unwrap_or([1; 16]);
    serial[0] &= 0x7f;
    p.serial_number = Some(SerialNumber::from_slice(&serial));
    Ok(p.signed_by(&csr.public_key, &issuer)?.pem())
}
