//! shoal-nbd (placeholder, being written)
