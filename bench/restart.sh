#!/usr/bin/env bash
# What a whole-cluster crash costs at restart (issue 23's target: the first
# read answered within 1 s of `shoal up` returning).
#
#   1. `shoal up` a 4-node cluster, one SIZE "raid1 ftt=1" volume;
#   2. fio 4 KiB random writes at QD32 for WRITE_S seconds through node 1;
#   3. every node killed -9 at once while fio writes;
#   4. `shoal up` again, timed; then one 4 KiB read of the volume through
#      node 2 (qemu-io over NBD), timed from `shoal up` returning;
#   5. the copies compared once the owner has reconciled (`shoal volume
#      verify`), and how long the reconciliation took (node logs).
#
# Usage: bench/restart.sh            Env (defaults in brackets):
#   SHOAL_BIN [target/release/shoal]  SKIP_BUILD [0]
#   BENCH_DIR [bench/results/restart-work]   SIZE [2G]   WRITE_S [10]
#   NET [127.0.51]   ROUNDS [3]
# Prints one line per round: up_s, first_read_s, regions reconciled and
# how long that took, and whether the copies agree; keeps the last round's
# node logs in bench/results/restart-<timestamp>/.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
SHOAL_BIN="${SHOAL_BIN:-$REPO/target/release/shoal}"
BENCH_DIR="${BENCH_DIR:-$REPO/bench/results/restart-work}"
SIZE="${SIZE:-2G}"
WRITE_S="${WRITE_S:-10}"
NET="${NET:-127.0.51}"
ROUNDS="${ROUNDS:-3}"
DATA="$BENCH_DIR/shoal"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  cargo build --release -p shoal-cli >/dev/null
fi
for t in fio qemu-io python3; do
  command -v "$t" >/dev/null || { echo "$t is required" >&2; exit 1; }
done

now() { python3 -c 'import time; print(time.monotonic())'; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.2f}')" "$1" "$2"; }

OUT="$REPO/bench/results/restart-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"
# The node logs of the last round, without colours.
keep_logs() {
  for f in "$DATA"/node*/node.log; do
    [ -f "$f" ] || continue
    sed 's/\x1b\[[0-9;]*m//g' "$f" >"$OUT/$(basename "$(dirname "$f")").log"
  done
}
cleanup() {
  keep_logs
  "$SHOAL_BIN" down --data "$DATA" >/dev/null 2>&1 || true
  rm -rf "$BENCH_DIR"
}
trap cleanup EXIT
logs() { sed 's/\x1b\[[0-9;]*m//g' "$DATA"/node*/node.log; }

round() {
  cleanup
  mkdir -p "$BENCH_DIR"
  "$SHOAL_BIN" up --data "$DATA" --nodes 4 --net "$NET" --no-demo >/dev/null
  "$SHOAL_BIN" volume create v --size "$SIZE" --policy "raid1 ftt=1" --data "$DATA" >/dev/null
  local uri="nbd+unix:///v?socket=$DATA/node1/nbd.sock"
  fio --name=w --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --iodepth=32 \
      --size="$SIZE" --time_based --runtime=$((WRITE_S + 30)) >/dev/null 2>&1 &
  local fio=$!
  sleep "$WRITE_S"
  kill -KILL $(for f in "$DATA"/node*/node.pid; do cat "$f"; echo; done)
  wait "$fio" 2>/dev/null || true
  local t0 t1 t2
  t0=$(now)
  "$SHOAL_BIN" up --data "$DATA" --no-demo >/dev/null
  t1=$(now)
  qemu-io -f raw -c 'read 0 4k' "nbd+unix:///v?socket=$DATA/node2/nbd.sock" >/dev/null
  t2=$(now)
  # Wait for the reconciliation to end, then compare the copies.
  local took=""
  for _ in $(seq 1 240); do
    took=$(logs | grep -o 'regions left in flight reconciled.*took=[^ ]*' | tail -1 || true)
    [ -n "$took" ] && break
    [ "$(logs | grep -c 'reconciling regions left in flight' || true)" -gt 0 ] || break
    sleep 0.5
  done
  local regions
  regions=$(logs | grep 'reconciling regions left in flight' | grep -o 'regions=[0-9]*' | tail -1 || true)
  local verify=ok
  "$SHOAL_BIN" volume verify v --data "$DATA" >"$OUT/verify.txt" 2>&1 || verify="FAILED ($OUT/verify.txt)"
  echo "up_s=$(since "$t0" "$t1") first_read_s=$(since "$t1" "$t2") ${regions:-regions=0} reconcile_took=${took##*took=} verify=$verify"
  [ "$verify" = ok ]
}

for i in $(seq 1 "$ROUNDS"); do
  round
done
