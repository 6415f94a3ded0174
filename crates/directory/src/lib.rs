//! shoal-directory (placeholder, being written)
