//! shoal-api (placeholder, being written)
