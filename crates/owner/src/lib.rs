//! shoal-owner (placeholder, being written)
