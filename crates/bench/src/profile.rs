//! Workload profiles: the built-in Easy Run set and custom profiles from a
//! TOML file.
//!
//! A custom profile file holds one or more `[[profile]]` tables:
//!
//! ```toml
//! [[profile]]
//! name = "oltp"
//! block_size = "8K"      # bytes or K/M suffix, a multiple of 512
//! read_pct = 70          # 0..=100, default 100
//! random_pct = 100       # 0..=100, default 100
//! outstanding = 8        # I/Os in flight per volume (default: by block size)
//! duration = "60s"       # measured time: seconds or "500ms", "30s", "2m"
//! warmup = "10s"         # run before measuring, not counted
//! rate_limit = 5000      # IOPS over all volumes (0 or absent: unlimited)
//! ```

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// One workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub name: String,
    /// Bytes per I/O.
    pub block_size: u64,
    /// Percent of I/Os that are reads.
    pub read_pct: u8,
    /// Percent of I/Os at a random offset; the rest continue sequentially.
    pub random_pct: u8,
    /// I/Os in flight per volume; `None`: the run's default for the block size.
    pub outstanding: Option<u32>,
    /// Measured seconds; `None`: the run's default.
    #[serde(with = "opt_secs")]
    pub duration: Option<Duration>,
    /// Warm-up seconds; `None`: the run's default.
    #[serde(with = "opt_secs")]
    pub warmup: Option<Duration>,
    /// IOPS over all volumes; `None`: unlimited.
    pub rate_limit: Option<u64>,
}

mod opt_secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.map(Duration::from_secs_f64))
    }
}

impl Profile {
    fn builtin(name: &str, bs: u64, read: u8, random: u8) -> Profile {
        Profile {
            name: name.into(),
            block_size: bs,
            read_pct: read,
            random_pct: random,
            outstanding: None,
            duration: None,
            warmup: None,
            rate_limit: None,
        }
    }

    /// A short description: `4 KiB, 70% read, 100% random`.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{}, {}% read, {}% random",
            shoal_model::human_size(self.block_size),
            self.read_pct,
            self.random_pct
        );
        if let Some(r) = self.rate_limit {
            s.push_str(&format!(", limited to {r} IOPS"));
        }
        s
    }

    /// Writes something.
    pub fn writes(&self) -> bool {
        self.read_pct < 100
    }

    /// Mostly random (latency-target mode's 1 ms default applies to these).
    pub fn is_random(&self) -> bool {
        self.random_pct >= 50
    }
}

const K: u64 = 1024;

/// The Easy Run set (HCIbench's six), in order.
pub fn easy_run() -> Vec<Profile> {
    vec![
        Profile::builtin("4k-randread", 4 * K, 100, 100),
        Profile::builtin("4k-randwrite", 4 * K, 0, 100),
        Profile::builtin("4k-rand70", 4 * K, 70, 100),
        Profile::builtin("8k-rand50", 8 * K, 50, 100),
        Profile::builtin("512k-seqread", 512 * K, 100, 0),
        Profile::builtin("512k-seqwrite", 512 * K, 0, 0),
    ]
}

/// Every built-in profile: the Easy Run set, 8K 70/30 random and 1M
/// sequential read and write.
pub fn builtins() -> Vec<Profile> {
    let mut v = easy_run();
    v.push(Profile::builtin("8k-rand70", 8 * K, 70, 100));
    v.push(Profile::builtin("1m-seqread", K * K, 100, 0));
    v.push(Profile::builtin("1m-seqwrite", K * K, 0, 0));
    v
}

/// Why a profile list or file was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProfileError {
    #[error("profile file: {0}")]
    Toml(String),
    #[error("profile file has no [[profile]] table")]
    Empty,
    #[error("profile {name:?}: {why}")]
    Invalid { name: String, why: String },
    #[error("two profiles are named {0:?}")]
    Duplicate(String),
    #[error("unknown profile {0:?}; built-in profiles: {1} (or the groups easy-run, all)")]
    Unknown(String, String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    profile: Vec<RawProfile>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeOrNumber {
    N(u64),
    S(String),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SecsOrText {
    N(f64),
    S(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    name: String,
    block_size: SizeOrNumber,
    read_pct: Option<i64>,
    random_pct: Option<i64>,
    outstanding: Option<i64>,
    duration: Option<SecsOrText>,
    warmup: Option<SecsOrText>,
    rate_limit: Option<i64>,
}

/// Parses `30`, `30s`, `500ms`, `2m`, `1.5s`, `250us`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, mult) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration: use seconds or 500ms, 30s, 2m"))?;
    if !v.is_finite() || v < 0.0 || v * mult > 1e7 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(v * mult))
}

fn pct(name: &str, what: &str, v: Option<i64>, default: u8) -> Result<u8, ProfileError> {
    match v {
        None => Ok(default),
        Some(v) if (0..=100).contains(&v) => Ok(v as u8),
        Some(v) => Err(ProfileError::Invalid {
            name: name.into(),
            why: format!("{what} = {v} is not a percentage (0 to 100)"),
        }),
    }
}

fn secs(name: &str, what: &str, v: Option<SecsOrText>) -> Result<Option<Duration>, ProfileError> {
    let bad = |why: String| ProfileError::Invalid {
        name: name.into(),
        why: format!("{what}: {why}"),
    };
    match v {
        None => Ok(None),
        Some(SecsOrText::N(n)) if n.is_finite() && (0.0..1e7).contains(&n) => {
            Ok(Some(Duration::from_secs_f64(n)))
        }
        Some(SecsOrText::N(n)) => Err(bad(format!("{n} is out of range"))),
        Some(SecsOrText::S(s)) => parse_duration(&s).map(Some).map_err(bad),
    }
}

impl RawProfile {
    fn check(self) -> Result<Profile, ProfileError> {
        let name = self.name.trim().to_string();
        let bad = |why: String| ProfileError::Invalid {
            name: name.clone(),
            why,
        };
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(bad("names use letters, digits, '-', '_' and '.'".into()));
        }
        let block_size = match self.block_size {
            SizeOrNumber::N(n) => n,
            SizeOrNumber::S(s) => shoal_model::parse_size(&s).map_err(|e| bad(e.to_string()))?,
        };
        if block_size == 0 || block_size % 512 != 0 || block_size > 32 * K * K {
            return Err(bad(format!(
                "block_size {block_size} must be a multiple of 512 bytes, at most 32 MiB"
            )));
        }
        let outstanding = match self.outstanding {
            None => None,
            Some(n) if (1..=1024).contains(&n) => Some(n as u32),
            Some(n) => return Err(bad(format!("outstanding = {n} must be 1 to 1024"))),
        };
        let rate_limit = match self.rate_limit {
            None | Some(0) => None,
            Some(n) if n > 0 => Some(n as u64),
            Some(n) => return Err(bad(format!("rate_limit = {n} must be positive"))),
        };
        let duration = secs(&name, "duration", self.duration)?;
        if duration == Some(Duration::ZERO) {
            return Err(bad("duration must be more than 0".into()));
        }
        Ok(Profile {
            read_pct: pct(&name, "read_pct", self.read_pct, 100)?,
            random_pct: pct(&name, "random_pct", self.random_pct, 100)?,
            block_size,
            outstanding,
            duration,
            warmup: secs(&name, "warmup", self.warmup)?,
            rate_limit,
            name,
        })
    }
}

/// Parses a profile file.
pub fn parse_file(text: &str) -> Result<Vec<Profile>, ProfileError> {
    let f: File = toml::from_str(text).map_err(|e| ProfileError::Toml(e.message().to_string()))?;
    if f.profile.is_empty() {
        return Err(ProfileError::Empty);
    }
    let v = f
        .profile
        .into_iter()
        .map(RawProfile::check)
        .collect::<Result<Vec<_>, _>>()?;
    no_duplicates(&v)?;
    Ok(v)
}

fn no_duplicates(v: &[Profile]) -> Result<(), ProfileError> {
    let mut seen = std::collections::HashSet::new();
    for p in v {
        if !seen.insert(p.name.as_str()) {
            return Err(ProfileError::Duplicate(p.name.clone()));
        }
    }
    Ok(())
}

/// Picks profiles by name from `available` (built-ins plus custom ones):
/// a comma-separated list of names and the groups `easy-run` and `all`.
pub fn select(list: &str, available: &[Profile]) -> Result<Vec<Profile>, ProfileError> {
    let mut out: Vec<Profile> = Vec::new();
    let add = |p: &Profile, out: &mut Vec<Profile>| {
        if !out.iter().any(|q| q.name == p.name) {
            out.push(p.clone());
        }
    };
    for w in list.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        match w {
            "easy-run" | "easyrun" => {
                for p in easy_run() {
                    add(&p, &mut out)
                }
            }
            "all" => {
                for p in available {
                    add(p, &mut out)
                }
            }
            _ => match available.iter().find(|p| p.name.eq_ignore_ascii_case(w)) {
                Some(p) => add(p, &mut out),
                None => {
                    let names: Vec<_> = available.iter().map(|p| p.name.as_str()).collect();
                    return Err(ProfileError::Unknown(w.into(), names.join(", ")));
                }
            },
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_are_the_documented_set() {
        let e = easy_run();
        assert_eq!(e.len(), 6);
        assert_eq!(
            (e[2].block_size, e[2].read_pct, e[2].random_pct),
            (4096, 70, 100)
        );
        assert_eq!(
            (e[5].block_size, e[5].read_pct, e[5].random_pct),
            (512 * 1024, 0, 0)
        );
        let all = builtins();
        assert_eq!(all.len(), 9);
        assert!(all.iter().any(|p| p.name == "1m-seqwrite"));
        no_duplicates(&all).unwrap();
    }

    #[test]
    fn parses_a_full_profile_file() {
        let v = parse_file(
            r#"
            [[profile]]
            name = "oltp"
            block_size = "8K"
            read_pct = 70
            random_pct = 90
            outstanding = 16
            duration = "1m"
            warmup = 5
            rate_limit = 2000

            [[profile]]
            name = "seq"
            block_size = 1048576
            read_pct = 0
            random_pct = 0
            duration = "500ms"
            "#,
        )
        .unwrap();
        assert_eq!(v.len(), 2);
        let p = &v[0];
        assert_eq!(p.name, "oltp");
        assert_eq!(p.block_size, 8192);
        assert_eq!((p.read_pct, p.random_pct), (70, 90));
        assert_eq!(p.outstanding, Some(16));
        assert_eq!(p.duration, Some(Duration::from_secs(60)));
        assert_eq!(p.warmup, Some(Duration::from_secs(5)));
        assert_eq!(p.rate_limit, Some(2000));
        assert_eq!(v[1].block_size, 1 << 20);
        assert_eq!(v[1].duration, Some(Duration::from_millis(500)));
        assert_eq!(v[1].outstanding, None);
        // defaults
        let v = parse_file("[[profile]]\nname='r'\nblock_size='4k'\n").unwrap();
        assert_eq!((v[0].read_pct, v[0].random_pct), (100, 100));
        assert_eq!(v[0].rate_limit, None);
    }

    #[test]
    fn refuses_bad_profile_files() {
        let err = |t: &str| parse_file(t).unwrap_err();
        assert!(matches!(err("not toml ["), ProfileError::Toml(_)));
        assert_eq!(err(""), ProfileError::Empty);
        assert!(matches!(
            err("[[profile]]\nname='a'\n"),
            ProfileError::Toml(_)
        ));
        assert!(matches!(
            err("[[profile]]\nname='a'\nblock_size='4k'\nbogus=1\n"),
            ProfileError::Toml(_)
        ));
        let invalid = |t: &str, word: &str| match parse_file(t).unwrap_err() {
            ProfileError::Invalid { why, .. } => assert!(why.contains(word), "{why}"),
            e => panic!("expected Invalid, got {e:?}"),
        };
        invalid(
            "[[profile]]\nname='a'\nblock_size=1000\n",
            "multiple of 512",
        );
        invalid("[[profile]]\nname='a'\nblock_size='4x'\n", "not understood");
        invalid("[[profile]]\nname='a'\nblock_size=0\n", "multiple of 512");
        invalid(
            "[[profile]]\nname='a'\nblock_size=4096\nread_pct=101\n",
            "percentage",
        );
        invalid(
            "[[profile]]\nname='a'\nblock_size=4096\nrandom_pct=-1\n",
            "percentage",
        );
        invalid(
            "[[profile]]\nname='a'\nblock_size=4096\noutstanding=0\n",
            "outstanding",
        );
        invalid(
            "[[profile]]\nname='a'\nblock_size=4096\nduration='soon'\n",
            "duration",
        );
        invalid(
            "[[profile]]\nname='a'\nblock_size=4096\nduration=0\n",
            "more than 0",
        );
        invalid(
            "[[profile]]\nname='a'\nblock_size=4096\nrate_limit=-5\n",
            "rate_limit",
        );
        invalid("[[profile]]\nname='a b'\nblock_size=4096\n", "names");
        assert_eq!(
            err("[[profile]]\nname='a'\nblock_size=4096\n[[profile]]\nname='a'\nblock_size=8192\n"),
            ProfileError::Duplicate("a".into())
        );
    }

    #[test]
    fn selects_by_name_and_group() {
        let all = builtins();
        let v = select("4k-randread, 1m-seqwrite", &all).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].name, "1m-seqwrite");
        assert_eq!(select("easy-run", &all).unwrap().len(), 6);
        assert_eq!(select("all,4k-randread", &all).unwrap().len(), 9);
        assert!(matches!(
            select("8k-nothing", &all),
            Err(ProfileError::Unknown(..))
        ));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1ms").unwrap(), Duration::from_millis(1));
        assert_eq!(parse_duration("250us").unwrap(), Duration::from_micros(250));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("fast").is_err());
    }
}
