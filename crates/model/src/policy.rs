//! Storage policies: what a volume asks of the cluster.
//!
//! Text form, words separated by spaces or commas, in any order:
//! `raid1 ftt=1`, `ftt=0`, `raid1 ftt=2 reserve=100 iops=5000`. Every word
//! either works or is refused: `checksum=off` is refused (every block is
//! checksummed), `raid5`/`raid6` are refused until they exist, a word given
//! twice is refused. `encrypt=on` encrypts the volume's data at rest.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How the copies of a volume are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    /// Mirroring: `ftt + 1` full copies and `ftt` witnesses.
    Raid1,
}

/// A storage policy. New fields are appended with serde defaults so that
/// stored directories stay readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub layout: Layout,
    /// Failures to tolerate, 0 to 3.
    pub ftt: u8,
    /// Percent of the size reserved up front (0 = thin).
    pub reserve_pct: u8,
    /// CRC-32C per block, verified on read. Always true: the store
    /// checksums every block, and `checksum=off` is refused.
    pub checksum: bool,
    /// IOPS limit of the whole volume, reads and writes together, each
    /// I/O counted in 32 KiB units (a 64 KiB I/O counts 2); 0 = none.
    pub iops_limit: u32,
    /// Data encrypted at rest and between nodes (XTS-AES-256 per 512-byte
    /// sector, at the node the client reaches): only ciphertext crosses
    /// the network and reaches the devices.
    #[serde(default)]
    pub encrypt: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            layout: Layout::Raid1,
            ftt: 1,
            reserve_pct: 0,
            checksum: true,
            iops_limit: 0,
            encrypt: false,
        }
    }
}

/// A policy text that cannot be a policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "unknown policy word {0:?}: expected raid1, ftt=N, reserve=PCT, thin, checksum=on, iops=N, encrypt=on|off"
    )]
    UnknownWord(String),
    #[error("ftt={0} is out of range: failures to tolerate must be 0 to 3")]
    FttRange(u64),
    #[error("{0} is not available yet: this version supports raid1 (ftt=0..3)")]
    Unsupported(String),
    #[error("bad value in {0:?}")]
    BadValue(String),
    #[error("{0:?} is given more than once")]
    Repeated(String),
    #[error(
        "checksum=off is not supported: every block of every volume is \
         checksummed end to end (checksum=on is the only setting)"
    )]
    ChecksumOff,
}

impl Policy {
    /// Full data copies.
    pub fn copies(&self) -> usize {
        match self.layout {
            Layout::Raid1 => self.ftt as usize + 1,
        }
    }

    /// Witness components: enough that `2 * ftt + 1` fault domains each
    /// carry one vote, so any `ftt` failures leave a strict majority.
    pub fn witnesses(&self) -> usize {
        match self.layout {
            Layout::Raid1 => self.ftt as usize,
        }
    }

    /// Distinct fault domains the policy needs.
    pub fn fault_domains_needed(&self) -> usize {
        self.copies() + self.witnesses()
    }
}

impl FromStr for Policy {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut p = Policy::default();
        let mut seen: Vec<String> = Vec::new();
        for w in s
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|w| !w.is_empty())
        {
            let lw = w.to_ascii_lowercase();
            let (k, v) = match lw.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (lw.clone(), None),
            };
            // The layout words and `thin` set the same things as others.
            let key = match k.as_str() {
                "raid1" | "mirror" => "layout",
                "thin" => "reserve",
                k => k,
            };
            if seen.iter().any(|s| s == key) {
                return Err(PolicyError::Repeated(key.to_string()));
            }
            seen.push(key.to_string());
            match (k.as_str(), v) {
                ("raid1" | "mirror", None) => p.layout = Layout::Raid1,
                ("raid5" | "raid6" | "raid-5" | "raid-6", None) => {
                    return Err(PolicyError::Unsupported(w.to_string()))
                }
                ("ftt", Some(v)) => {
                    let n: u64 = v.parse().map_err(|_| PolicyError::BadValue(w.into()))?;
                    if n > 3 {
                        return Err(PolicyError::FttRange(n));
                    }
                    p.ftt = n as u8;
                }
                ("reserve", Some(v)) => {
                    let n: u8 = v
                        .trim_end_matches('%')
                        .parse()
                        .map_err(|_| PolicyError::BadValue(w.into()))?;
                    if n > 100 {
                        return Err(PolicyError::BadValue(w.into()));
                    }
                    p.reserve_pct = n;
                }
                ("thin", None) => p.reserve_pct = 0,
                ("checksum", Some(v)) => match v.as_str() {
                    "on" | "true" | "1" => p.checksum = true,
                    "off" | "false" | "0" => return Err(PolicyError::ChecksumOff),
                    _ => return Err(PolicyError::BadValue(w.into())),
                },
                ("encrypt", Some(v)) => match v.as_str() {
                    "on" | "true" | "1" => p.encrypt = true,
                    "off" | "false" | "0" => p.encrypt = false,
                    _ => return Err(PolicyError::BadValue(w.into())),
                },
                ("iops", Some(v)) => {
                    p.iops_limit = v.parse().map_err(|_| PolicyError::BadValue(w.into()))?
                }
                _ => return Err(PolicyError::UnknownWord(w.to_string())),
            }
        }
        if seen.is_empty() {
            // Empty, or only separators (" ", ","): not a policy.
            return Err(PolicyError::UnknownWord(s.to_string()));
        }
        Ok(p)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.layout {
            Layout::Raid1 => write!(f, "raid1 ftt={}", self.ftt)?,
        }
        if self.reserve_pct > 0 {
            write!(f, " reserve={}", self.reserve_pct)?;
        }
        if self.iops_limit > 0 {
            write!(f, " iops={}", self.iops_limit)?;
        }
        if self.encrypt {
            write!(f, " encrypt=on")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_the_documented_forms() {
        let p: Policy = "ftt=0".parse().unwrap();
        assert_eq!((p.copies(), p.witnesses()), (1, 0));
        let p: Policy = "raid1 ftt=1".parse().unwrap();
        assert_eq!(p.fault_domains_needed(), 3);
        let p: Policy = "raid1 ftt=2".parse().unwrap();
        assert_eq!(p.fault_domains_needed(), 5);
        assert!(matches!(
            "raid1 ftt=4".parse::<Policy>(),
            Err(PolicyError::FttRange(4))
        ));
        assert!(matches!(
            "raid9".parse::<Policy>(),
            Err(PolicyError::UnknownWord(_))
        ));
        assert!(matches!(
            "raid5 ftt=1".parse::<Policy>(),
            Err(PolicyError::Unsupported(_))
        ));
        assert!("".parse::<Policy>().is_err());
        assert!(",".parse::<Policy>().is_err());
        assert!(" , ".parse::<Policy>().is_err());
        assert_eq!(
            "ftt=1 ftt=2".parse::<Policy>(),
            Err(PolicyError::Repeated("ftt".into()))
        );
        assert_eq!(
            "raid1 mirror".parse::<Policy>(),
            Err(PolicyError::Repeated("layout".into()))
        );
        assert_eq!(
            "thin reserve=10".parse::<Policy>(),
            Err(PolicyError::Repeated("reserve".into()))
        );
        let p: Policy = "raid1,ftt=2,iops=500,checksum=on".parse().unwrap();
        assert_eq!((p.ftt, p.iops_limit, p.checksum), (2, 500, true));
        assert!(matches!(
            "iops=-1".parse::<Policy>(),
            Err(PolicyError::BadValue(_))
        ));
    }

    /// The checksum cannot be turned off: every block is checksummed by
    /// the store, so the word is refused rather than accepted and ignored.
    #[test]
    fn checksum_off_is_refused() {
        for w in ["checksum=off", "raid1 ftt=1 checksum=false", "checksum=0"] {
            assert_eq!(w.parse::<Policy>(), Err(PolicyError::ChecksumOff), "{w}");
        }
        let e = PolicyError::ChecksumOff.to_string();
        assert!(e.contains("not supported"), "{e}");
    }

    proptest! {
        #[test]
        fn display_round_trips(ftt in 0u8..=3, reserve in 0u8..=100, iops in 0u32..100000, encrypt: bool) {
            let p = Policy { layout: Layout::Raid1, ftt, reserve_pct: reserve, checksum: true, iops_limit: iops, encrypt };
            let q: Policy = p.to_string().parse().unwrap();
            prop_assert_eq!(p, q);
        }
    }
}
