//! The capacity leg of an erasure-coded volume, for its owner
//! (`docs/erasure-coding.md`).
//!
//! - `columns`: the stripe columns over RPC (activation, whole-stripe
//!   writes, block reads and degraded reads);
//! - `tiered`: the owner of an erasure-coded volume, in front of the
//!   performance leg's RAID-1 owner and the columns.

mod columns;
mod tiered;

pub use columns::{BlockRead, BlockReads, ColumnError, ColumnSet, ColumnTarget};
pub use tiered::TieredOwner;
