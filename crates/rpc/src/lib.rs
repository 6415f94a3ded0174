//! shoal-rpc (placeholder, being written)
