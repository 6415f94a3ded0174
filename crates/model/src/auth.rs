//! API tokens: who may call the REST API, and what they may do.
//!
//! A token's text is `shoal-<id>-<secret>`: `id` (16 hex digits) names it
//! and is public (logs, `shoal token list`); `secret` (64 hex digits, 256
//! random bits) proves it. The directory keeps only the SHA-256 of the
//! secret, so a copy of the directory grants nothing.
//!
//! A join token (role [`Role::Join`]) lets a new node ask for its
//! certificate and nothing else. Its text also names the cluster it joins:
//! `shoal-join-<id>-<secret>-<ca>`, `ca` the SHA-256 of the cluster CA's
//! certificate, so the joining node hands its secret only to a member of
//! that cluster.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;
use std::str::FromStr;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Read anything (status, volumes, metrics); change nothing.
    ReadOnly,
    /// Everything a person or a tool may do.
    Admin,
    /// Only: ask for a new node's certificate (`POST /v1/join`).
    Join,
}

impl Role {
    /// Whether this role may do what `needed` allows on the REST API. A
    /// join token allows nothing there.
    pub fn allows(self, needed: Role) -> bool {
        matches!(
            (self, needed),
            (Role::Admin, Role::Admin | Role::ReadOnly)
                | (Role::ReadOnly, Role::ReadOnly)
                | (Role::Join, Role::Join)
        )
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::ReadOnly => "read-only",
            Role::Admin => "admin",
            Role::Join => "join",
        })
    }
}

impl FromStr for Role {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "read-only" | "readonly" => Ok(Role::ReadOnly),
            "admin" => Ok(Role::Admin),
            "join" => Ok(Role::Join),
            _ => Err(TokenError::BadRole(s.to_string())),
        }
    }
}

/// A token as the directory keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiToken {
    /// Public name, 16 hex digits.
    pub id: String,
    pub role: Role,
    /// SHA-256 of the secret, hex.
    pub secret_sha256: String,
    /// What it is for, as its creator said.
    pub note: String,
    /// When it stops opening anything, in seconds since the Unix epoch
    /// (join tokens; API tokens last until revoked).
    #[serde(default)]
    pub expires_unix_s: Option<u64>,
}

impl ApiToken {
    /// Whether it has expired at `now_unix_s`.
    pub fn expired(&self, now_unix_s: u64) -> bool {
        self.expires_unix_s.is_some_and(|e| now_unix_s >= e)
    }
}

/// The cluster's certificate authority as the directory keeps it: every
/// member can then sign a joining node's certificate. Never shown by the
/// API; `Debug` hides the key.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaRecord {
    pub cert_pem: String,
    pub key_pem: String,
}

impl fmt::Debug for CaRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CaRecord(..)")
    }
}

/// A join token's text: the token, and the pin of the cluster it joins.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinTokenText {
    pub token: TokenText,
    /// SHA-256 of the cluster CA's certificate (DER), 64 hex digits.
    pub ca_sha256: String,
}

impl fmt::Debug for JoinTokenText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JoinTokenText({})", self.token.id)
    }
}

impl JoinTokenText {
    /// The full text to hand to the node's operator (once).
    pub fn reveal(&self) -> String {
        format!(
            "shoal-join-{}-{}-{}",
            self.token.id, self.token.secret, self.ca_sha256
        )
    }
}

impl FromStr for JoinTokenText {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s
            .trim()
            .strip_prefix("shoal-join-")
            .ok_or(TokenError::NotJoin)?;
        let mut parts = rest.split('-');
        let (Some(id), Some(secret), Some(ca), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(TokenError::NotJoin);
        };
        if !is_hex(id, 16) || !is_hex(secret, 64) || !is_hex(ca, 64) {
            return Err(TokenError::NotJoin);
        }
        Ok(JoinTokenText {
            token: TokenText {
                id: id.to_string(),
                secret: secret.to_string(),
            },
            ca_sha256: ca.to_string(),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("not a Shoal token: expected shoal-<16 hex digits>-<64 hex digits>")]
    Malformed,
    #[error(
        "not a join token: expected shoal-join-<16 hex digits>-<64 hex digits>-<64 hex digits>"
    )]
    NotJoin,
    #[error("unknown role {0:?}: expected admin, read-only or join")]
    BadRole(String),
}

/// A token's text: its id and secret.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenText {
    pub id: String,
    secret: String,
}

impl fmt::Debug for TokenText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secret.
        write!(f, "TokenText({})", self.id)
    }
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl TokenText {
    /// A new token from 8 random bytes of id and 32 of secret.
    pub fn new(id: [u8; 8], secret: [u8; 32]) -> TokenText {
        TokenText {
            id: hex(&id),
            secret: hex(&secret),
        }
    }

    /// The full text to hand to its holder (once).
    pub fn reveal(&self) -> String {
        format!("shoal-{}-{}", self.id, self.secret)
    }

    /// SHA-256 of the secret, hex: what the directory keeps.
    pub fn secret_sha256(&self) -> String {
        hex(&Sha256::digest(self.secret.as_bytes()))
    }

    /// Whether this text proves `token`.
    pub fn proves(&self, token: &ApiToken) -> bool {
        self.id == token.id && self.secret_sha256() == token.secret_sha256
    }
}

impl FromStr for TokenText {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let rest = s
            .trim()
            .strip_prefix("shoal-")
            .ok_or(TokenError::Malformed)?;
        let (id, secret) = rest.split_once('-').ok_or(TokenError::Malformed)?;
        if !is_hex(id, 16) || !is_hex(secret, 64) {
            return Err(TokenError::Malformed);
        }
        Ok(TokenText {
            id: id.to_string(),
            secret: secret.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_token_proves_itself_and_nothing_else() {
        let t = TokenText::new([1; 8], [2; 32]);
        let rec = ApiToken {
            id: t.id.clone(),
            role: Role::Admin,
            secret_sha256: t.secret_sha256(),
            note: String::new(),
            expires_unix_s: None,
        };
        let back: TokenText = t.reveal().parse().unwrap();
        assert!(back.proves(&rec));
        let other = TokenText::new([1; 8], [3; 32]);
        assert!(!other.proves(&rec), "same id, other secret");
        assert!(!format!("{t:?}").contains(&t.reveal()[23..]));
        assert!(Role::Admin.allows(Role::ReadOnly));
        assert!(!Role::ReadOnly.allows(Role::Admin));
        assert_eq!("read-only".parse::<Role>(), Ok(Role::ReadOnly));
        assert!("root".parse::<Role>().is_err());
        assert!(!Role::Join.allows(Role::ReadOnly) && !Role::Admin.allows(Role::Join));
    }

    #[test]
    fn a_join_token_names_its_cluster_and_expires() {
        let j = JoinTokenText {
            token: TokenText::new([4; 8], [5; 32]),
            ca_sha256: "ab".repeat(32),
        };
        let back: JoinTokenText = j.reveal().parse().unwrap();
        assert_eq!(back, j);
        assert!(j.token.reveal().parse::<JoinTokenText>().is_err());
        assert!(j.reveal().parse::<TokenText>().is_err());
        assert!(!format!("{j:?}").contains(&j.token.secret));
        let t = ApiToken {
            id: j.token.id.clone(),
            role: Role::Join,
            secret_sha256: j.token.secret_sha256(),
            note: String::new(),
            expires_unix_s: Some(100),
        };
        assert!(!t.expired(99) && t.expired(100));
    }

    proptest! {
        #[test]
        fn garbage_is_never_a_join_token(s in "shoal-join-[0-9a-f-]{0,200}") {
            if let Ok(t) = s.parse::<JoinTokenText>() {
                prop_assert_eq!(t.reveal(), s.trim());
            }
        }

        #[test]
        fn garbage_is_never_a_token(s in ".{0,120}") {
            if let Ok(t) = s.parse::<TokenText>() {
                prop_assert!(s.trim().starts_with("shoal-"));
                prop_assert_eq!(t.reveal(), s.trim());
            }
        }
    }
}
