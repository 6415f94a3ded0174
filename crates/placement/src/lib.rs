//! shoal-placement (placeholder, being written)
