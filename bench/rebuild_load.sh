#!/usr/bin/env bash
# Client latency during a rebuild (issue 23's target: with the adaptive
# pace, 4K random read p99 during a rebuild at most 3x its value without
# one).
#
#   1. `shoal up` 4 nodes, repair delay 1 s, a SIZE "raid1 ftt=1" volume
#      written in full (fio, 1 MiB sequential);
#   2. fio 4K random reads, queue depth QD, RUNTIME seconds, through the
#      owner's node: the p99 without a rebuild;
#   3. per resync-mib-per-s value in LIMITS (0: adaptive): a fresh
#      cluster as in 1, a data copy's node other than the owner's killed
#      -9, and once the owner logs "resync copying" the same fio run: the
#      p99 during the rebuild, and whether the rebuild outlasted it.
#
# Usage: bench/rebuild_load.sh        Env (defaults in brackets):
#   SHOAL_BIN [target/release/shoal]  SKIP_BUILD [0]  SIZE_MIB [2048]
#   QD [4]  RUNTIME [10]  LIMITS ["0 10000"]  NET [127.0.54]
#   BENCH_DIR [bench/results/rebuild-load-work]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
SHOAL_BIN="${SHOAL_BIN:-$REPO/target/release/shoal}"
BENCH_DIR="${BENCH_DIR:-$REPO/bench/results/rebuild-load-work}"
SIZE_MIB="${SIZE_MIB:-2048}"
QD="${QD:-4}"
RUNTIME="${RUNTIME:-10}"
LIMITS="${LIMITS:-0 10000}"
NET="${NET:-127.0.54}"
DATA="$BENCH_DIR/shoal"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  cargo build --release -p shoal-cli >/dev/null
fi
for t in fio python3; do
  command -v "$t" >/dev/null || { echo "$t is required" >&2; exit 1; }
done

cleanup() {
  "$SHOAL_BIN" down --data "$DATA" >/dev/null 2>&1 || true
  rm -rf "$BENCH_DIR"
}
trap cleanup EXIT
shoal() { "$SHOAL_BIN" "$@" --data "$DATA"; }
logs() { sed 's/\x1b\[[0-9;]*m//g' "$DATA"/node*/node.log; }
URI() { echo "nbd+unix:///v?socket=$DATA/node1/nbd.sock"; }

# A fresh cluster with the volume written in full.
start() {
  cleanup
  mkdir -p "$BENCH_DIR"
  shoal up --nodes 4 --net "$NET" --no-demo --repair-delay 1s >/dev/null
  shoal cluster set resync-mib-per-s "$1" >/dev/null
  shoal volume create v --size "${SIZE_MIB}M" --policy "raid1 ftt=1" >/dev/null
  fio --name=fill --ioengine=nbd --uri="$(URI)" --rw=write --bs=1M --iodepth=8 \
      --size="${SIZE_MIB}M" >/dev/null 2>&1
}

# p99 of 4K random reads over RUNTIME seconds, in microseconds.
p99() {
  fio --name=randread --ioengine=nbd --uri="$(URI)" --rw=randread --bs=4k \
      --iodepth="$QD" --size="${SIZE_MIB}M" --time_based --runtime="$RUNTIME" \
      --output-format=json 2>/dev/null | python3 -c '
import json, sys
text = sys.stdin.read()  # the nbd engine prints a line before the JSON
j = json.loads(text[text.find("{"):])["jobs"][0]["read"]
p99 = j["clat_ns"]["percentile"]["99.000000"] / 1000
print("%.0f %.0f" % (p99, j["iops"]))'
}

start 0
read -r base base_iops < <(p99)
echo "no rebuild: p99 ${base} us at ${base_iops} IOPS (QD $QD)"
for l in $LIMITS; do
  start "$l"
  victim=$(shoal volume show v --json | python3 -c '
import json, sys
v = json.load(sys.stdin)["volume"]
print([c["node"] for c in v["components"] if c["role"] == "Data" and c["node"] != v.get("owner")][0])')
  kill -KILL "$(cat "$DATA/node$victim/node.pid")"
  for _ in $(seq 1 600); do
    logs | grep -q 'resync copying' && break
    sleep 0.1
  done
  read -r during iops < <(p99)
  [ -n "${KEEP_LOG:-}" ] && logs > "$KEEP_LOG.$l" || true
  if logs | grep -q 'added copy in sync'; then outlasted=no; else outlasted=yes; fi
  python3 -c "
mode = 'adaptive' if $l == 0 else 'static $l MiB/s'
print(f'rebuild, {mode}: p99 $during us at $iops IOPS = {$during / $base:.2f}x without; rebuild still running at the end: $outlasted')"
done
