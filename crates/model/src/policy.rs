//! Storage policies: what a volume asks of the cluster.
//!
//! Text form, words separated by spaces or commas, in any order:
//! `raid1 ftt=1`, `ftt=0`, `raid1 ftt=2 reserve=100 iops=5000 checksum=off`.

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
    /// CRC-32C per block, verified on read.
    pub checksum: bool,
    /// IOPS limit (normalised to 32 KiB), 0 = none.
    pub iops_limit: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            layout: Layout::Raid1,
            ftt: 1,
            reserve_pct: 0,
            checksum: true,
            iops_limit: 0,
        }
    }
}

/// A policy text that cannot be a policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "unknown policy word {0:?}: expected raid1, ftt=N, reserve=PCT, checksum=on|off, iops=N"
    )]
    UnknownWord(String),
    #[error("ftt={0} is out of range: failures to tolerate must be 0 to 3")]
    FttRange(u64),
    #[error("{0} is not available yet: this version supports raid1 (ftt=0..3)")]
    Unsupported(String),
    #[error("bad value in {0:?}")]
    BadValue(String),
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
        let mut ftt_seen = false;
        for w in s
            .split(|c: char| c.is_whitespace() || c == ',')
            .filter(|w| !w.is_empty())
        {
            let lw = w.to_ascii_lowercase();
            let (k, v) = match lw.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (lw.clone(), None),
            };
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
                    ftt_seen = true;
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
                ("checksum", Some(v)) => {
                    p.checksum = match v.as_str() {
                        "on" | "true" | "1" => true,
                        "off" | "false" | "0" => false,
                        _ => return Err(PolicyError::BadValue(w.into())),
                    }
                }
                ("iops", Some(v)) => {
                    p.iops_limit = v.parse().map_err(|_| PolicyError::BadValue(w.into()))?
                }
                _ => return Err(PolicyError::UnknownWord(w.to_string())),
            }
        }
        if !ftt_seen && s.trim().is_empty() {
            return Err(PolicyError::UnknownWord(String::new()));
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
        if !self.checksum {
            write!(f, " checksum=off")?;
        }
        if self.iops_limit > 0 {
            write!(f, " iops={}", self.iops_limit)?;
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
    }

    proptest! {
        #[test]
        fn display_round_trips(ftt in 0u8..=3, reserve in 0u8..=100, checksum: bool, iops in 0u32..100000) {
            let p = Policy { layout: Layout::Raid1, ftt, reserve_pct: reserve, checksum, iops_limit: iops };
            let q: Policy = p.to_string().parse().unwrap();
            prop_assert_eq!(p, q);
        }
    }
}
