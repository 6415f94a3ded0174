#!/usr/bin/env bash
# Sets everything up and runs Shoal's main job: a local 4-node cluster on
# loopback serving a mirrored volume over NBD. Extra arguments go to `shoal up`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cargo build --release -p shoal-cli
exec target/release/shoal up "$@"
