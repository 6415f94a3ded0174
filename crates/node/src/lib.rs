//! shoal-node (placeholder, being written)
