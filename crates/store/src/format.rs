//! Constants shared by every device format: the magic that marks a Shoal
//! device (the first 8 bytes of its superblock) and the limits the node
//! relies on. The layout itself is in [`crate::log::format`].

/// First 8 bytes of every Shoal device, whatever its format version.
pub const MAGIC: &[u8; 8] = b"SHOALDEV";
/// Smallest device Shoal accepts, in bytes: below this the log's reserve
/// segments and checkpoint slots leave no useful space.
pub const MIN_CAPACITY: u64 = 64 << 20;
/// Default limit on the components of one device.
pub const SLOTS: u32 = 1024;
/// Longest cluster id a superblock holds, in bytes.
pub const MAX_CLUSTER_ID: usize = 64;
