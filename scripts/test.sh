#!/usr/bin/env bash
# Runs every test: unit and property tests of each crate, cluster tests that
# start real `shoal` processes, and interop tests with real NBD clients.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo build --workspace --all-targets
# Cluster tests start several node processes each: two at a time is what a
# 2-core machine carries without turning timeouts into failures.
cargo test --workspace -- --test-threads=2
