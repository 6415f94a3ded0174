#!/usr/bin/env bash
# How fast a lost copy is rebuilt (issue 23's targets: at least half the
# copy rate dd achieves between files on the same disk; with the static
# limit, within 10% of it).
#
#   1. dd copies a SIZE file to another on the same file system (direct
#      I/O, 1 MiB blocks): the machine's file-to-file copy rate;
#   2. `shoal up` NODES nodes, repair delay 1 s, resync limit LIMIT (0:
#      none), a SIZE volume of POLICY written in full (fio, 1 MiB
#      sequential); with "raid1 ftt=2" (5 nodes) two in-sync copies are
#      left to read from;
#   3. a data copy's node other than the owner's killed -9; the rebuild's
#      copy time read from the owner's log ("resync copying" to "added
#      copy in sync"), its bytes from the regions copied.
#
# Usage: bench/rebuild.sh        Env (defaults in brackets):
#   SHOAL_BIN [target/release/shoal]  SKIP_BUILD [0]  SIZE_MIB [1024]
#   LIMITS ["0 50"] (MiB/s; one rebuild each)   NET [127.0.52]
#   POLICY ["raid1 ftt=1"]  NODES [4]
#   BENCH_DIR [bench/results/rebuild-work]
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
SHOAL_BIN="${SHOAL_BIN:-$REPO/target/release/shoal}"
BENCH_DIR="${BENCH_DIR:-$REPO/bench/results/rebuild-work}"
SIZE_MIB="${SIZE_MIB:-1024}"
LIMITS="${LIMITS:-0 50}"
POLICY="${POLICY:-raid1 ftt=1}"
NODES="${NODES:-4}"
NET="${NET:-127.0.52}"
DATA="$BENCH_DIR/shoal"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  cargo build --release -p shoal-cli >/dev/null
fi
for t in fio dd python3; do
  command -v "$t" >/dev/null || { echo "$t is required" >&2; exit 1; }
done

cleanup() {
  "$SHOAL_BIN" down --data "$DATA" >/dev/null 2>&1 || true
  rm -rf "$BENCH_DIR"
}
trap cleanup EXIT
logs() { sed 's/\x1b\[[0-9;]*m//g' "$DATA"/node*/node.log; }
# Seconds between the first log line matching $1 and the first matching $2.
between() {
  logs | python3 -c '
import re, sys
from datetime import datetime
a, b = sys.argv[1], sys.argv[2]
ta = tb = None
for line in sys.stdin:
    m = re.match(r"(\S+Z)", line)
    if not m:
        continue
    t = datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
    if ta is None and a in line:
        ta = t
    if ta is not None and tb is None and b in line and t >= ta:
        tb = t
print(f"{(tb - ta).total_seconds():.2f}" if ta and tb else "nan")' "$1" "$2"
}

dd_rate() {
  mkdir -p "$BENCH_DIR"
  dd if=/dev/urandom of="$BENCH_DIR/a" bs=1M count="$SIZE_MIB" status=none
  sync
  local t0 t1
  t0=$(date +%s.%N)
  dd if="$BENCH_DIR/a" of="$BENCH_DIR/b" bs=1M iflag=direct oflag=direct status=none
  sync
  t1=$(date +%s.%N)
  rm -f "$BENCH_DIR/a" "$BENCH_DIR/b"
  python3 -c "print(f'{$SIZE_MIB / ($t1 - $t0):.0f}')"
}

rebuild_rate() {
  local limit=$1
  cleanup
  mkdir -p "$BENCH_DIR"
  "$SHOAL_BIN" up --data "$DATA" --nodes "$NODES" --net "$NET" --no-demo --repair-delay 1s >/dev/null
  "$SHOAL_BIN" cluster set resync-mib-per-s "$limit" --data "$DATA" >/dev/null
  "$SHOAL_BIN" volume create v --size "${SIZE_MIB}M" --policy "$POLICY" --data "$DATA" >/dev/null
  fio --name=fill --ioengine=nbd --uri="nbd+unix:///v?socket=$DATA/node1/nbd.sock" \
      --rw=write --bs=1M --iodepth=8 --size="${SIZE_MIB}M" >/dev/null 2>&1
  local victim
  victim=$("$SHOAL_BIN" volume show v --json --data "$DATA" | python3 -c '
import json, sys
v = json.load(sys.stdin)["volume"]
print([c["node"] for c in v["components"] if c["role"] == "Data" and c["node"] != v.get("owner")][0])')
  kill -KILL "$(cat "$DATA/node$victim/node.pid")"
  for _ in $(seq 1 600); do
    logs | grep -q 'reconfiguration committed' && break
    sleep 0.5
  done
  local secs regions
  secs=$(between 'resync copying' 'added copy in sync')
  regions=$(logs | grep 'resync copying' | grep -o 'regions=[0-9]*' | tail -1 | cut -d= -f2)
  python3 -c "
s, r = float('$secs'), int('${regions:-0}')
print(f'limit {$limit} MiB/s: {r} MiB in {s:.2f} s = {r / s:.0f} MiB/s' if s > 0 else 'no rebuild seen')"
}

echo "dd file to file: $(dd_rate) MiB/s"
for l in $LIMITS; do
  rebuild_rate "$l"
done
