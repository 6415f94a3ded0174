#!/usr/bin/env bash
# Runs every check: formatting (cargo fmt), lints (clippy, warnings as
# errors), then unit and property tests of each crate, cluster tests that
# start real `shoal` processes, and interop tests with real NBD clients.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
# Formatting and lints first: a tree that fails them does not land.
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo build --workspace --all-targets
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Cluster tests start several node processes each: two at a time is what a
# 2-core machine carries without turning timeouts into failures.
set +e
cargo test --workspace --all-targets --no-fail-fast -- --test-threads=2 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
passed=$(awk '/^test result:/ { for (i = 1; i < NF; i++) if ($(i+1) ~ /^passed/) s += $i } END { print s + 0 }' "$log")
failed=$(awk '/^test result:/ { for (i = 1; i < NF; i++) if ($(i+1) ~ /^failed/) s += $i } END { print s + 0 }' "$log")
echo
echo "summary: ${passed:-0} passed, ${failed:-0} failed"
exit "$status"
