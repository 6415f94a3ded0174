//! shoal-cli (placeholder, being written)
