//! Storage policies: what a volume asks of the cluster.
//!
//! Text form, words separated by spaces or commas, in any order:
//! `raid1 ftt=1`, `ftt=0`, `raid1 ftt=2 reserve=100 iops=5000`. Every word
//! either works or is refused: `checksum=off` is refused (every block is
//! checksummed), `raid5 ftt=2` is refused (an erasure-coded layout
//! tolerates exactly one number of failures: [`Layout::fixed_ftt`]), a
//! word given twice is refused. `encrypt=on` encrypts the volume's data at rest.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// How the copies of a volume are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    /// Mirroring: `ftt + 1` full copies and `ftt` witnesses.
    Raid1,
    /// Erasure coding with one parity, `ftt = 1` (`docs/erasure-coding.md`):
    /// a mirrored performance leg (2 copies and a witness) in front of a
    /// capacity leg of 2+1 stripe components on 3 to 5 fault domains, 4+1
    /// on 6 or more ([`StripeGeometry::raid5_for`]).
    Raid5,
    /// Erasure coding with two parities, `ftt = 2`: a performance leg of 3
    /// copies and 2 witnesses in front of 4+2 stripe components.
    Raid6,
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(layout_word(*self))
    }
}

impl Layout {
    /// The only `ftt` an erasure-coded layout has (None: RAID-1, any).
    pub fn fixed_ftt(self) -> Option<u8> {
        match self {
            Layout::Raid1 => None,
            Layout::Raid5 => Some(1),
            Layout::Raid6 => Some(2),
        }
    }

    /// Whether the layout has a capacity leg of stripes.
    pub fn is_erasure(self) -> bool {
        self != Layout::Raid1
    }
}

/// The data and parity shards of a stripe of an erasure-coded volume,
/// chosen when the volume is placed and recorded in it
/// ([`crate::Volume::stripe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StripeGeometry {
    pub data: u8,
    pub parity: u8,
}

impl StripeGeometry {
    /// RAID-5 on 3 to 5 fault domains: 2 data + 1 parity (1.5x).
    pub const RAID5_NARROW: StripeGeometry = StripeGeometry { data: 2, parity: 1 };
    /// RAID-5 on 6 fault domains or more: 4 data + 1 parity (1.25x).
    pub const RAID5_WIDE: StripeGeometry = StripeGeometry { data: 4, parity: 1 };
    /// RAID-6: 4 data + 2 parity (1.5x), on 6 fault domains or more.
    pub const RAID6: StripeGeometry = StripeGeometry { data: 4, parity: 2 };

    /// Fault domains the narrowest RAID-5 needs.
    pub const RAID5_MIN_DOMAINS: usize = 3;
    /// Fault domains from which RAID-5 goes wide (vSAN ESA's adaptive
    /// choice), and which RAID-6 needs.
    pub const WIDE_MIN_DOMAINS: usize = 6;

    /// The geometry `layout` takes on a cluster of `fault_domains` usable
    /// fault domains (None: RAID-1, or too few domains).
    pub fn for_layout(layout: Layout, fault_domains: usize) -> Option<StripeGeometry> {
        match layout {
            Layout::Raid1 => None,
            Layout::Raid5 => Self::raid5_for(fault_domains),
            Layout::Raid6 => (fault_domains >= Self::WIDE_MIN_DOMAINS).then_some(Self::RAID6),
        }
    }

    /// RAID-5's geometry on `fault_domains` fault domains.
    pub fn raid5_for(fault_domains: usize) -> Option<StripeGeometry> {
        match fault_domains {
            n if n < Self::RAID5_MIN_DOMAINS => None,
            n if n < Self::WIDE_MIN_DOMAINS => Some(Self::RAID5_NARROW),
            _ => Some(Self::RAID5_WIDE),
        }
    }

    /// Stripe components, each on a fault domain of its own.
    pub fn width(self) -> usize {
        usize::from(self.data) + usize::from(self.parity)
    }
}

impl fmt::Display for StripeGeometry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}+{}", self.data, self.parity)
    }
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
        "unknown policy word {0:?}: expected raid1, raid5, raid6, ftt=N, reserve=PCT, thin, checksum=on, iops=N, encrypt=on|off"
    )]
    UnknownWord(String),
    #[error("ftt={0} is out of range: failures to tolerate must be 0 to 3")]
    FttRange(u64),
    #[error("bad value in {0:?}")]
    BadValue(String),
    #[error("{layout} tolerates exactly ftt={fixed}, not ftt={asked}")]
    LayoutFtt {
        layout: &'static str,
        fixed: u8,
        asked: u8,
    },
    #[error("{0:?} is given more than once")]
    Repeated(String),
    #[error(
        "checksum=off is not supported: every block of every volume is \
         checksummed end to end (checksum=on is the only setting)"
    )]
    ChecksumOff,
}

impl Policy {
    /// Full data copies: of the volume (RAID-1), or of its performance
    /// leg (RAID-5/6), `ftt + 1` either way.
    pub fn copies(&self) -> usize {
        self.ftt as usize + 1
    }

    /// Witness components: enough that `2 * ftt + 1` fault domains each
    /// carry one vote, so any `ftt` failures leave a strict majority. An
    /// erasure-coded volume's votes are its performance leg's: its stripe
    /// components carry none (they are fenced by the generation, and hold
    /// nothing the performance leg's map does not name).
    pub fn witnesses(&self) -> usize {
        self.ftt as usize
    }

    /// Distinct fault domains the policy needs: the votes' `2 * ftt + 1`,
    /// and for RAID-5/6 also the narrowest stripe's width (each leg on
    /// distinct domains; the two legs share them).
    pub fn fault_domains_needed(&self) -> usize {
        let votes = self.copies() + self.witnesses();
        match self.layout {
            Layout::Raid1 => votes,
            Layout::Raid5 => votes.max(StripeGeometry::RAID5_MIN_DOMAINS),
            Layout::Raid6 => votes.max(StripeGeometry::WIDE_MIN_DOMAINS),
        }
    }
}

impl FromStr for Policy {
    type Err = PolicyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut p = Policy::default();
        let mut seen: Vec<String> = Vec::new();
        let mut ftt_given = None;
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
                "raid1" | "mirror" | "raid5" | "raid-5" | "raid6" | "raid-6" => "layout",
                "thin" => "reserve",
                k => k,
            };
            if seen.iter().any(|s| s == key) {
                return Err(PolicyError::Repeated(key.to_string()));
            }
            seen.push(key.to_string());
            match (k.as_str(), v) {
                ("raid1" | "mirror", None) => p.layout = Layout::Raid1,
                ("raid5" | "raid-5", None) => p.layout = Layout::Raid5,
                ("raid6" | "raid-6", None) => p.layout = Layout::Raid6,
                ("ftt", Some(v)) => {
                    let n: u64 = v.parse().map_err(|_| PolicyError::BadValue(w.into()))?;
                    if n > 3 {
                        return Err(PolicyError::FttRange(n));
                    }
                    p.ftt = n as u8;
                    ftt_given = Some(p.ftt);
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
        p.fix_erasure_ftt(ftt_given)?;
        Ok(p)
    }
}

impl Policy {
    /// An erasure-coded layout takes its one `ftt` when none was given,
    /// and refuses any other.
    fn fix_erasure_ftt(&mut self, given: Option<u8>) -> Result<(), PolicyError> {
        let Some(fixed) = self.layout.fixed_ftt() else {
            return Ok(());
        };
        match given {
            Some(asked) if asked != fixed => Err(PolicyError::LayoutFtt {
                layout: layout_word(self.layout),
                fixed,
                asked,
            }),
            _ => {
                self.ftt = fixed;
                Ok(())
            }
        }
    }
}

/// The policy word of a layout.
fn layout_word(l: Layout) -> &'static str {
    match l {
        Layout::Raid1 => "raid1",
        Layout::Raid5 => "raid5",
        Layout::Raid6 => "raid6",
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ftt={}", layout_word(self.layout), self.ftt)?;
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
        for (w, layout, ftt) in [
            ("raid5 ftt=1", Layout::Raid5, 1),
            ("raid5", Layout::Raid5, 1),
            ("ftt=1 raid-5", Layout::Raid5, 1),
            ("raid6", Layout::Raid6, 2),
            ("raid6 ftt=2", Layout::Raid6, 2),
        ] {
            let p: Policy = w.parse().unwrap();
            assert_eq!((p.layout, p.ftt), (layout, ftt), "{w}");
        }
        assert_eq!(
            "raid5 ftt=2".parse::<Policy>(),
            Err(PolicyError::LayoutFtt {
                layout: "raid5",
                fixed: 1,
                asked: 2
            })
        );
        assert!(matches!(
            "ftt=0 raid6".parse::<Policy>(),
            Err(PolicyError::LayoutFtt { fixed: 2, .. })
        ));
        assert_eq!(
            "raid1 raid5".parse::<Policy>(),
            Err(PolicyError::Repeated("layout".into()))
        );
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

    #[test]
    fn erasure_layouts_need_their_stripes_domains_and_choose_their_width() {
        let p = |layout, ftt| Policy {
            layout,
            ftt,
            ..Policy::default()
        };
        let r5 = p(Layout::Raid5, 1);
        assert_eq!((r5.copies(), r5.witnesses()), (2, 1));
        assert_eq!(r5.fault_domains_needed(), 3);
        assert_eq!(r5.to_string(), "raid5 ftt=1");
        let r6 = p(Layout::Raid6, 2);
        assert_eq!((r6.copies(), r6.witnesses()), (3, 2));
        assert_eq!(r6.fault_domains_needed(), 6);
        assert_eq!(r6.to_string(), "raid6 ftt=2");
        let g = |l, n| StripeGeometry::for_layout(l, n).map(|g| g.to_string());
        assert_eq!(g(Layout::Raid5, 2), None);
        assert_eq!(g(Layout::Raid5, 3).as_deref(), Some("2+1"));
        assert_eq!(g(Layout::Raid5, 5).as_deref(), Some("2+1"));
        assert_eq!(g(Layout::Raid5, 6).as_deref(), Some("4+1"));
        assert_eq!(g(Layout::Raid6, 5), None);
        assert_eq!(g(Layout::Raid6, 8).as_deref(), Some("4+2"));
        assert_eq!(g(Layout::Raid1, 8), None);
        assert_eq!(StripeGeometry::RAID6.width(), 6);
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
