//! Threads and batching of a node's data path, set in the node's config
//! (`[tuning]` in `--config node.toml`) and passed down to the devices'
//! flushers and readers. The defaults are the settings that measured best
//! (bench/RESULTS.md); the fields exist for hosts unlike the one measured.

use serde::{Deserialize, Serialize};

/// Flusher threads per device by default: one; with two, the next sync
/// writes its batch while the previous one flushes the device, which
/// measured slower on the virtual disk of the test machine
/// (bench/RESULTS.md, 2026-11-30, the node's write path).
pub const SYNC_THREADS_DEFAULT: usize = 1;

/// Longest wait of the flusher for writes that arrived with the ones it is
/// about to sync, in microseconds: a burst of writes read from one
/// connection is applied within a few microseconds, and a sync that waits
/// for it covers it all instead of the first one or two.
pub const GATHER_US_DEFAULT: u64 = 100;

/// Reader threads per device by default, each taking at most
/// [`READ_BATCH_DEFAULT`] reads: small batches on two threads keep some
/// reads at the device while others are answered (bench/RESULTS.md,
/// 2026-11-30, QD1 writes and QD32 reads).
pub const READ_THREADS_DEFAULT: usize = 2;

/// Most reads one reader thread takes from its queue at once.
pub const READ_BATCH_DEFAULT: usize = 8;

/// Knobs of the data path. Every field has a default; a config file names
/// only what it changes, and an unknown field is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeTuning {
    /// Threads of the node's async runtime; None: one per core.
    pub workers: Option<usize>,
    /// Flusher threads per device: syncs (group commits) at once, 1 to 4.
    pub sync_threads: usize,
    /// Longest wait of a sync for writes still being applied, in
    /// microseconds, 0 to 10,000 (0: no waiting).
    pub gather_us: u64,
    /// Reader threads per device (reads off the io_uring path), 1 to 8.
    pub read_threads: usize,
    /// Most reads one reader thread takes at once, 1 to 256.
    pub read_batch: usize,
}

impl Default for NodeTuning {
    fn default() -> Self {
        NodeTuning {
            workers: None,
            sync_threads: SYNC_THREADS_DEFAULT,
            gather_us: GATHER_US_DEFAULT,
            read_threads: READ_THREADS_DEFAULT,
            read_batch: READ_BATCH_DEFAULT,
        }
    }
}

impl NodeTuning {
    /// Refuses settings out of their range (rather than clamping them
    /// silently).
    pub fn validate(&self) -> Result<(), String> {
        let check = |name: &str, v: u64, lo: u64, hi: u64| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("tuning.{name} = {v} is out of range {lo} to {hi}"))
            }
        };
        if let Some(w) = self.workers {
            check("workers", w as u64, 1, 256)?;
        }
        check("sync_threads", self.sync_threads as u64, 1, 4)?;
        check("gather_us", self.gather_us, 0, 10_000)?;
        check("read_threads", self.read_threads as u64, 1, 8)?;
        check("read_batch", self.read_batch as u64, 1, 256)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_ranges_refused() {
        assert_eq!(NodeTuning::default().validate(), Ok(()));
        let bad = NodeTuning {
            read_threads: 0,
            ..NodeTuning::default()
        };
        assert!(bad.validate().unwrap_err().contains("read_threads"));
        let bad = NodeTuning {
            workers: Some(0),
            ..NodeTuning::default()
        };
        assert!(bad.validate().is_err());
    }
}
