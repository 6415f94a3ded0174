#!/usr/bin/env bash
# What a copy that returns before the repair delay gets back (issue 23's
# target: after a 30 s absence with 64 MiB of sequential writes into a
# 2 GiB volume, at most 2x the bytes written are copied).
#
#   1. `shoal up` 4 nodes (repair delay left at its 60 min default), a
#      SIZE "raid1 ftt=1" volume written in full (fio, 1 MiB sequential),
#      so that a full copy would move SIZE;
#   2. a data copy's node other than the owner's stopped (SIGSTOP) until
#      the owner records its copy absent; WRITE MiB written sequentially
#      in the middle of the volume; the node resumed ABSENCE seconds after
#      it was stopped;
#   3. once the volume is healthy again: the bytes the resync wrote into
#      the returning copy (its node's shoal_resync_bytes_total) against
#      the bytes written while it was away.
#
# Usage: bench/resync.sh        Env (defaults in brackets):
#   SHOAL_BIN [target/release/shoal]  SKIP_BUILD [0]  SIZE_MIB [2048]
#   WRITE_MIB [64]  ABSENCE_S [30]  NET [127.0.53]
#   BENCH_DIR [bench/results/resync-work]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
SHOAL_BIN="${SHOAL_BIN:-$REPO/target/release/shoal}"
BENCH_DIR="${BENCH_DIR:-$REPO/bench/results/resync-work}"
SIZE_MIB="${SIZE_MIB:-2048}"
WRITE_MIB="${WRITE_MIB:-64}"
ABSENCE_S="${ABSENCE_S:-30}"
NET="${NET:-127.0.53}"
DATA="$BENCH_DIR/shoal"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  cargo build --release -p shoal-cli >/dev/null
fi
for t in fio curl python3; do
  command -v "$t" >/dev/null || { echo "$t is required" >&2; exit 1; }
done

cleanup() {
  for p in "$DATA"/node*/node.pid; do
    [ -f "$p" ] && kill -CONT "$(cat "$p")" 2>/dev/null || true
  done
  "$SHOAL_BIN" down --data "$DATA" >/dev/null 2>&1 || true
  rm -rf "$BENCH_DIR"
}
trap cleanup EXIT
shoal() { "$SHOAL_BIN" "$@" --data "$DATA"; }
show() { shoal volume show v --json; }
# The resync bytes written on node $1 (its /metrics).
resync_bytes() {
  local api
  api=$(shoal status --json | python3 -c '
import json, sys
n = [x for x in json.load(sys.stdin)["nodes"] if x["id"] == int(sys.argv[1])][0]
print(n["api_addr"])' "$1")
  curl -sS -H "Authorization: Bearer $(cat "$DATA/admin.token")" "http://$api/metrics" |
    awk '/^shoal_resync_bytes_total/ {s += $NF} END {print s + 0}'
}

cleanup
mkdir -p "$BENCH_DIR"
shoal up --nodes 4 --net "$NET" --no-demo >/dev/null
shoal volume create v --size "${SIZE_MIB}M" --policy "raid1 ftt=1" >/dev/null
fio --name=fill --ioengine=nbd --uri="nbd+unix:///v?socket=$DATA/node1/nbd.sock" \
    --rw=write --bs=1M --iodepth=8 --size="${SIZE_MIB}M" >/dev/null 2>&1
victim=$(show | python3 -c '
import json, sys
v = json.load(sys.stdin)["volume"]
print([c["node"] for c in v["components"] if c["role"] == "Data" and c["node"] != v.get("owner")][0])')
before=$(resync_bytes "$victim")
pid=$(cat "$DATA/node$victim/node.pid")
t0=$(date +%s)
kill -STOP "$pid"
# A write makes the owner find the copy gone and record it absent.
fio --name=write --ioengine=nbd --uri="nbd+unix:///v?socket=$DATA/node1/nbd.sock" \
    --rw=write --bs=1M --iodepth=8 --offset="$((SIZE_MIB / 2))M" --size="${WRITE_MIB}M" \
    >/dev/null 2>&1
left=$((ABSENCE_S - ($(date +%s) - t0)))
[ "$left" -gt 0 ] && sleep "$left"
kill -CONT "$pid"
t1=$(date +%s.%N)
for _ in $(seq 1 600); do
  [ "$(show | python3 -c 'import json, sys; print(json.load(sys.stdin)["health"])')" = Healthy ] && break
  sleep 0.5
done
t2=$(date +%s.%N)
after=$(resync_bytes "$victim")
python3 -c "
copied = ($after - $before) / 2**20
print(f'absent {$ABSENCE_S} s, {$WRITE_MIB} MiB written: resync copied {copied:.0f} MiB '
      f'= {copied / $WRITE_MIB:.2f}x the bytes written (a full copy: {$SIZE_MIB} MiB); '
      f'healthy {$t2 - $t1:.1f} s after the node resumed')"
