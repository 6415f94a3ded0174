//! How one member checks another, and how a joining node checks the
//! cluster it was told to join before it hands over its join token.

use crate::{hex, provider, TlsError};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The DNS name every node's certificate carries: a member is checked as
/// a member, whatever address it was reached on (addresses change when a
/// node moves; its membership does not).
pub const MEMBER_NAME: &str = "member.shoal";

fn member_name() -> ServerName<'static> {
    ServerName::DnsName(
        rustls::pki_types::DnsName::try_from(MEMBER_NAME)
            .expect("a valid DNS name")
            .to_owned(),
    )
}

/// Roots holding only `ca`.
pub(crate) fn roots(ca: &CertificateDer<'static>) -> Result<Arc<RootCertStore>, TlsError> {
    let mut r = RootCertStore::empty();
    r.add(ca.clone())
        .map_err(|e| TlsError::Cert(format!("the cluster CA: {e}")))?;
    Ok(Arc::new(r))
}

/// The handshake signature checks of both verifiers: the provider's
/// algorithms, whatever the chain was checked against.
fn tls12_signature(
    message: &[u8],
    cert: &CertificateDer<'_>,
    dss: &DigitallySignedStruct,
) -> Result<HandshakeSignatureValid, rustls::Error> {
    let algs = provider().signature_verification_algorithms;
    rustls::crypto::verify_tls12_signature(message, cert, dss, &algs)
}

fn tls13_signature(
    message: &[u8],
    cert: &CertificateDer<'_>,
    dss: &DigitallySignedStruct,
) -> Result<HandshakeSignatureValid, rustls::Error> {
    let algs = provider().signature_verification_algorithms;
    rustls::crypto::verify_tls13_signature(message, cert, dss, &algs)
}

fn schemes() -> Vec<SignatureScheme> {
    provider()
        .signature_verification_algorithms
        .supported_schemes()
}

/// Checks that a server is a member: its chain leads to the cluster CA and
/// its certificate names [`MEMBER_NAME`] (the name dialled is ignored).
#[derive(Debug)]
pub(crate) struct MemberVerifier {
    inner: Arc<WebPkiServerVerifier>,
}

impl MemberVerifier {
    pub(crate) fn new(ca: &CertificateDer<'static>) -> Result<MemberVerifier, TlsError> {
        let inner = WebPkiServerVerifier::builder_with_provider(roots(ca)?, provider())
            .build()
            .map_err(|e| TlsError::Cert(e.to_string()))?;
        Ok(MemberVerifier { inner })
    }
}

impl ServerCertVerifier for MemberVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, &member_name(), ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        schemes()
    }
}

/// The SHA-256 of the cluster CA's certificate (DER), as a join token
/// carries it: a joining node talks only to a server whose chain ends in
/// that CA, so a join token is never handed to an impostor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinPin(pub String);

impl JoinPin {
    /// The pin of `ca_pem`.
    pub fn of_pem(ca_pem: &str) -> Result<JoinPin, TlsError> {
        Ok(JoinPin(crate::fingerprint(&crate::creds::cert_from_pem(
            ca_pem,
        )?)))
    }

    /// A verifier that accepts a member of the pinned cluster: the server
    /// sends its CA after its own certificate, and the CA must hash to the
    /// pin. `mismatch` is set when a server showed another CA.
    pub(crate) fn verifier(&self, mismatch: Arc<AtomicBool>) -> Arc<PinVerifier> {
        Arc::new(PinVerifier {
            pin: self.clone(),
            mismatch,
        })
    }
}

#[derive(Debug)]
pub(crate) struct PinVerifier {
    pin: JoinPin,
    mismatch: Arc<AtomicBool>,
}

impl PinVerifier {
    fn member_verifier(
        &self,
        intermediates: &[CertificateDer<'_>],
    ) -> Result<MemberVerifier, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|c| hex(&Sha256::digest(c.as_ref())) == self.pin.0)
            .ok_or_else(|| {
                self.mismatch.store(true, Ordering::SeqCst);
                rustls::Error::General(
                    "this server's CA is not the one the join token names".into(),
                )
            })?;
        MemberVerifier::new(&ca.clone().into_owned())
            .map_err(|e| rustls::Error::General(e.to_string()))
    }
}

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.member_verifier(intermediates)?
            .verify_server_cert(end_entity, &[], name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        schemes()
    }
}
