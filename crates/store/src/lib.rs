//! shoal-store (placeholder, being written)
