#!/usr/bin/env bash
# Issue 3's cluster targets as medians over several whole runs of
# bench/cluster.sh, so that one disturbed run (this kind of machine's disk
# and CPU are shared with other guests) does not decide a verdict.
#
# Usage: bench/rounds.sh [cluster.sh options, e.g. --quick]
#        bench/rounds.sh --report ROUNDS_DIR   (only rewrite ROUNDS_DIR/rounds.md)
# Env (defaults in brackets):
#   ROUNDS [3]     whole runs of bench/cluster.sh, one after the other
#   TARGETS        passed on; the ratios need "shoal" and "raw" (nbdkit is
#                  left out unless asked for: TARGETS="shoal nbdkit raw")
#   everything else as for bench/cluster.sh (SKIP_BUILD, RUNTIME, ...)
#
# Each run sets up its own cluster and raw file, runs every job on Shoal,
# then on the raw file, and writes its own folder under
# bench/results/rounds-<timestamp>/. rounds.md there has each run's three
# ratios and their medians (with the rule: median ≥ 0.40 for QD32 writes,
# ≤ 2.5x for QD1 durable writes, ≥ 0.70 for QD32 reads).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

# report DIR: (re)writes DIR/rounds.md from the runs' fio JSON.
report() {
  python3 - "$1" >"$1/rounds.md" <<'PY'
import json, os, statistics, sys

root = sys.argv[1]

def iops(run, job, target):
    """IOPS of one job on one target, from fio's JSON; None if absent."""
    path = os.path.join(root, run, f"{job}__{target}.json")
    try:
        text = open(path).read()
    except OSError:
        return None
    start = text.find("{")  # fio's nbd engine prints a line first
    if start < 0:
        return None
    try:
        jobs = json.loads(text[start:])["jobs"]
    except (ValueError, KeyError):
        return None
    rw = "read" if job.startswith("rr") else "write"
    total = sum(j[rw]["iops"] for j in jobs)
    return total or None

rows = []
for run in sorted(os.listdir(root)):
    if not os.path.isdir(os.path.join(root, run)):
        continue
    w = (iops(run, "rw4k_qd32", "shoal"), iops(run, "rw4k_qd32", "raw"))
    q = (iops(run, "rw4k_qd1", "shoal"), iops(run, "rw4k_qd1", "raw"))
    r = (iops(run, "rr4k_qd32", "shoal"), iops(run, "rr4k_qd32", "raw"))
    ratio = lambda a, b: a / b if a and b else None
    rows.append((run, w, ratio(*w), q, ratio(q[1], q[0]), r, ratio(*r)))

def fmt(x, unit=""):
    return "–" if x is None else f"{x:.2f}{unit}"

def k(x):
    return "–" if x is None else f"{x / 1000:.1f}k"

def us(x):
    return "–" if x is None else f"{1e6 / x:,.0f} µs"

print("# Issue 3 cluster targets over whole runs of bench/cluster.sh\n")
print("Ratios per run (Shoal against the raw file in the same run), and their medians.\n")
print("| Run | 4K randwrite QD32: Shoal / raw | 4K QD1 durable, 1/IOPS: Shoal / raw | 4K randread QD32: Shoal / raw |")
print("|---|---|---|---|")
for run, w, wr, q, qr, r, rr in rows:
    print(f"| {run} | {k(w[0])} / {k(w[1])} = {fmt(wr)} | {us(q[0])} / {us(q[1])} = {fmt(qr, 'x')} "
          f"| {k(r[0])} / {k(r[1])} = {fmt(rr)} |")

def med(i):
    xs = [row[i] for row in rows if row[i] is not None]
    return (statistics.median(xs), len(xs)) if xs else (None, 0)

(wm, wn), (qm, qn), (rm, rn) = med(2), med(4), med(6)
print(f"| **median** (runs) | **{fmt(wm)}** ({wn}) | **{fmt(qm, 'x')}** ({qn}) | **{fmt(rm)}** ({rn}) |")
print()
verdict = lambda ok: "HOLDS" if ok else "MISSED"
if wm is not None:
    print(f"- 4K random write QD32 ≥ 0.40 of the raw file's IOPS: median {wm:.2f} → **{verdict(wm >= 0.40)}**")
if qm is not None:
    print(f"- 4K QD1 durable write ≤ 2.5x the raw file's (1/IOPS): median {qm:.2f}x → **{verdict(qm <= 2.5)}**")
if rm is not None:
    print(f"- 4K random read QD32 ≥ 0.70 of the raw file's IOPS: median {rm:.2f} → **{verdict(rm >= 0.70)}**")
print("\nEach run's own table (with nbdkit, latencies, the log's metrics and the disk) is its folder's table.md.")
PY
}

if [ "${1:-}" = "--report" ]; then
  [ -d "${2:-}" ] || { echo "usage: $0 --report ROUNDS_DIR" >&2; exit 2; }
  report "$2"
  cat "$2/rounds.md"
  exit 0
fi

ROUNDS="${ROUNDS:-3}"
case "$ROUNDS" in ''|*[!0-9]*|0) echo "ROUNDS must be a positive number" >&2; exit 2 ;; esac
export TARGETS="${TARGETS:-shoal raw}"
DIR="${RESULTS_ROOT:-$REPO/bench/results}/rounds-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$DIR"
for i in $(seq 1 "$ROUNDS"); do
  echo "[rounds] run $i of $ROUNDS" >&2
  # The first run builds (unless told not to); the others use its binary.
  RESULTS_ROOT="$DIR" bash "$REPO/bench/cluster.sh" "$@" >"$DIR/run-$i.log" 2>&1 ||
    echo "[rounds] run $i failed: see $DIR/run-$i.log" >&2
  export SKIP_BUILD=1
  # Each run's folder is named by the second it started: keep them apart.
  sleep 1
done
report "$DIR"
cat "$DIR/rounds.md"
echo
echo "results: $DIR"
