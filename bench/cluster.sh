#!/usr/bin/env bash
# Shoal vs nbdkit-file vs raw file: the same fio jobs, side by side, on one disk.
#
#   A  shoal   4-node local cluster (NET.1..4), one "raid1 ftt=1" volume,
#              fio --ioengine=nbd against node 1
#   B  nbdkit  nbdkit's file plugin serving a file, fio --ioengine=nbd
#   C  raw     a plain file, fio --ioengine=io_uring --direct=1 (libaio if
#              io_uring is refused)
#
# Usage: bench/cluster.sh [--quick] [--help]
#        bench/cluster.sh --report RESULTS_DIR   (only rewrite RESULTS_DIR/table.md)
# Env (defaults in brackets):
#   BENCH_DIR [bench/results/work]  where the big files and the cluster live
#   RESULTS_ROOT [bench/results]    the run's folder is RESULTS_ROOT/<timestamp>
#   RUNTIME [15, 5 with --quick]    seconds measured per fio job
#   RAMP [3, 1 with --quick]        seconds of ramp before measuring
#   SIZE [2G]                       volume / file size
#   DEVICE_SIZE [4G]                each Shoal node's device file, written in
#                                   full (`shoal up --thick`) like the nbdkit and
#                                   raw files, so no target pays for block
#                                   allocation in the file system; THICK=0 keeps
#                                   them sparse
#   POLICY ["raid1 ftt=1"]          the Shoal volume's policy (e.g. add encrypt=on)
#   ENCRYPT [0]                     1: `shoal up --encrypt-in-transit` (TLS for
#                                   the whole life of the connections between
#                                   nodes; default: mutual TLS, then the
#                                   authenticated bare stream)
#   NET [127.0.50]                  Shoal nodes are NET.1..NET.4
#   NBD_PORT [10809]                Shoal's NBD port
#   NBDKIT_ADDR [127.0.0.1] NBDKIT_PORT [10859]
#   TARGETS ["shoal nbdkit raw"]    which targets to run
#   TRANSPORT [unix]                how fio reaches Shoal and nbdkit: unix, a
#                                   Unix socket (node 1's DATA/node1/nbd.sock,
#                                   as a virtual machine on the node's own host
#                                   would), or tcp (loopback TCP, as a client on
#                                   another host would; the replicas talk TCP
#                                   to each other either way)
#   INTERLEAVE [0]                  1: set every target up, then run each job on
#                                   all targets before the next job (write
#                                   ratios from runs a minute apart); 0: all
#                                   jobs of one target, then the next. Reads
#                                   differ: the virtual disk's host caches
#                                   what was written last, so interleaved,
#                                   Shoal (written first) read 15.5k IOPS
#                                   against the raw file's 84.9k, and the
#                                   device file itself reads at 12-21k from
#                                   fio; one target after the other, each
#                                   reads its own fresh data
#   EXTRA [0]                       1 adds context rows: QD1 without sync for
#                                   nbdkit/raw, QD1 with a flush per write for Shoal
#   SHOAL_BIN [target/release/shoal]
#   SKIP_BUILD [0]                  1 skips `cargo build --release -p shoal-cli`
#   KEEP [0]                        1 keeps the big files and the cluster data
#   FIO_TIMEOUT_SLACK [120]         seconds past ramp+runtime before a fio run is killed
#   PREFILL_TIMEOUT [900]           seconds before a prefill is killed
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

# ---------------------------------------------------------------- report
# report DIR: (re)writes DIR/table.md from the fio JSON in DIR.
report() {
  # shellcheck disable=SC2046
  python3 - "$1" $(cat "$1/report-args") >"$1/table.md" <<'PY'
import json, os, sys

out, raw_engine, sync_nbdkit, extra, size, runtime, ramp = sys.argv[1:8]
transport = sys.argv[8] if len(sys.argv) > 8 else "tcp"
interleave = len(sys.argv) > 9 and sys.argv[9] == "1"
extra = extra == "1"
targets = ["shoal", "nbdkit", "raw"]
tname = {"shoal": "Shoal (raid1 ftt=1, 4 nodes)", "nbdkit": "nbdkit-file", "raw": f"raw file ({raw_engine})"}


def load(job, t):
    p = os.path.join(out, f"{job}__{t}.json")
    if not os.path.exists(p) or os.path.exists(os.path.join(out, f"{job}__{t}.failed")):
        return None
    j = json.load(open(p))["jobs"][0]
    rw = "read" if j["read"]["io_bytes"] > 0 else "write"
    d = j[rw]
    pct = d["clat_ns"].get("percentile", {})
    r = {
        "iops": d["iops"],
        "mibs": d["bw_bytes"] / 2**20,
        "clat_mean": d["clat_ns"]["mean"] / 1000,
        "clat_p99": pct.get("99.000000", 0) / 1000,
        "sync_mean": None,
        "sync_p99": None,
    }
    s = j.get("sync", {})
    # async engines (io_uring) leave sync.total_ios at 0 but count lat_ns.N
    if s.get("total_ios", 0) > 0 or s.get("lat_ns", {}).get("N", 0) > 0:
        r["sync_mean"] = s["lat_ns"]["mean"] / 1000
        r["sync_p99"] = s["lat_ns"].get("percentile", {}).get("99.000000", 0) / 1000
    # latency of a durable write: the write plus the sync that follows it
    r["durable"] = r["clat_mean"] + (r["sync_mean"] or 0)
    r["cycle"] = 1e6 / r["iops"] if r["iops"] else None
    return r


def k(x):
    return f"{x/1000:.1f}k" if x >= 10000 else f"{x:,.0f}"


def us(x):
    if x is None:
        return "–"
    if x >= 10000:
        return f"{x/1000:.1f} ms"
    return f"{x:,.0f} µs" if x >= 100 else f"{x:.1f} µs"


# job id, label, kind
jobs = [
    ("prefill", f"(prefill) 1M seq write QD8, first write of all {size}", "seq"),
    ("rw4k_qd32", "4K random write QD32", "iops"),
    ("rw4k_qd1", "4K random write QD1, durable", "lat"),
]
if extra:
    jobs.append(("rw4k_qd1x", "(extra) 4K rand write QD1: Shoal + flush each / others no sync", "lat"))
jobs += [
    ("rr4k_qd32", "4K random read QD32 (prefilled)", "iops"),
    ("sw1m_qd8", "1M sequential write QD8", "seq"),
]
R = {(j, t): load(j, t) for j, _, _ in jobs for t in targets}


def cell(kind, r):
    if r is None:
        return "n/a"
    if kind == "iops":
        return f"{k(r['iops'])} IOPS, {r['mibs']:.0f} MiB/s, mean {us(r['clat_mean'])}, p99 {us(r['clat_p99'])}"
    if kind == "lat":
        s = f"**{us(r['durable'])}**"
        if r["sync_mean"] is not None:
            s += f" (write {us(r['clat_mean'])} + sync {us(r['sync_mean'])})"
        return s + f", {k(r['iops'])} IOPS, write p99 {us(r['clat_p99'])}"
    return f"{r['mibs']:.0f} MiB/s, mean {us(r['clat_mean'])}, p99 {us(r['clat_p99'])}"


def ratio(kind, a, b):
    if a is None or b is None:
        return "n/a"
    if kind == "iops":
        return f"{a['iops']/b['iops']:.2f}x IOPS" if b["iops"] else "n/a"
    if kind == "lat":
        return f"{a['durable']/b['durable']:.2f}x latency" if b["durable"] else "n/a"
    return f"{a['mibs']/b['mibs']:.2f}x MiB/s" if b["mibs"] else "n/a"


p = print
p(f"# Shoal vs nbdkit-file vs raw file ({size}, {runtime} s runs after {ramp} s ramp)")
p()
p(f"NBD clients (fio's nbd engine) reach Shoal's node 1 and nbdkit over "
  f"{'a Unix socket' if transport == 'unix' else 'TCP on loopback'}"
  f"{'; jobs interleaved across targets' if interleave else ''}.")
p()
p("| Job | " + " | ".join(tname[t] for t in targets) + " | Shoal/raw | Shoal/nbdkit |")
p("|---|" + "---|" * (len(targets) + 2))
for j, label, kind in jobs:
    row = [label] + [cell(kind, R[(j, t)]) for t in targets]
    row += [ratio(kind, R[(j, "shoal")], R[(j, "raw")]), ratio(kind, R[(j, "shoal")], R[(j, "nbdkit")])]
    p("| " + " | ".join(row) + " |")
p()
p("Latencies are fio completion latencies (clat). \"durable\" = mean write clat plus, where a")
p("sync op follows each write, its mean latency. QD1 durable options: Shoal none (it acks only")
p(f"writes durable on every copy); nbdkit-file `{sync_nbdkit}`; raw file `--fdatasync=1`.")
p()

p("## Targets (issue 3, through the whole cluster)")
p()
p("The QD1 target is judged on the time per durable write (1/IOPS, submission included);")
p("the mean completion latency (clat, plus the sync op's for the raw file) is shown beside it.")
p()


def floor_target(job, name, want):
    a, b = R[(job, "shoal")], R[(job, "raw")]
    if not (a and b and b["iops"]):
        p(f"- {name} ≥ {want:.0%} of the raw file's: not measured (a run failed or was not run)")
        return
    f = a["iops"] / b["iops"]
    p(f"- {name} ≥ {want:.0%} of the raw file's: Shoal {k(a['iops'])} vs raw {k(b['iops'])} IOPS = "
      f"{f:.2f} → **{'HOLDS' if f >= want else 'MISSED'}**")


floor_target("rw4k_qd32", "4K random write QD32 IOPS", 0.40)
a, b = R[("rw4k_qd1", "shoal")], R[("rw4k_qd1", "raw")]
if a and b and a["cycle"] and b["cycle"]:
    g = a["cycle"] / b["cycle"]
    f = a["durable"] / b["durable"] if b["durable"] else float("nan")
    p(f"- 4K QD1 durable write ≤ 2.5x the raw file's with fdatasync: Shoal {us(a['cycle'])} vs raw "
      f"{us(b['cycle'])} per write (1/IOPS) = {g:.2f}x → **{'HOLDS' if g <= 2.5 else 'MISSED'}** "
      f"(clat: {us(a['durable'])} vs {us(b['durable'])} = {f:.2f}x)")
else:
    p("- 4K QD1 durable write ≤ 2.5x the raw file's: not measured (a run failed or was not run)")
floor_target("rr4k_qd32", "4K random read QD32 IOPS", 0.70)
if interleave:
    p("  (interleaved run: the read row is not a fair comparison, see bench/README.md)")
p()

p("## All numbers")
p()
p("| Job | Target | IOPS | MiB/s | clat mean | clat p99 | sync mean | sync p99 | 1/IOPS |")
p("|---|---|---|---|---|---|---|---|---|")
for j, label, kind in jobs:
    for t in targets:
        r = R[(j, t)]
        if r is None:
            failed = os.path.exists(os.path.join(out, f"{j}__{t}.failed"))
            p(f"| {j} | {t} | {'FAILED' if failed else 'not run'} | | | | | | |")
            continue
        p(f"| {j} | {t} | {r['iops']:,.0f} | {r['mibs']:,.1f} | {us(r['clat_mean'])} | {us(r['clat_p99'])} | "
          f"{us(r['sync_mean'])} | {us(r['sync_p99'])} | {us(r['cycle'])} |")

def log_work(job):
    def load(which):
        f = os.path.join(out, f"{job}__shoal.log-{which}")
        d = {}
        if os.path.exists(f):
            for line in open(f):
                n, k, v = line.split()
                d[(n, k)] = float(v)
        return d
    a, b = load("before"), load("after")
    if not a or not b:
        return None
    tot = {}
    for (n, k), v in b.items():
        if (n, k) in a:
            tot.setdefault(n, {})[k.replace("shoal_device_", "").replace("_total", "")] = v - a[(n, k)]
    return tot

rows = []
for j in ["prefill", "rw4k_qd32", "rw4k_qd1", "rr4k_qd32", "sw1m_qd8"]:
    w = log_work(j)
    if not w:
        continue
    for n in sorted(w):
        d = w[n]
        if not d.get("syncs") and not d.get("cleaner_blocks") and not d.get("checkpoints"):
            continue
        syncs = d.get("syncs", 0)
        rows.append(f"| {j} | {n} | {syncs:,.0f} | "
                    f"{us(d.get('sync_microseconds', 0) / syncs) if syncs else '–'} | "
                    f"{d.get('cleaner_blocks', 0):,.0f} | {d.get('cleaned_segments', 0):,.0f} | "
                    f"{d.get('cleaner_waits', 0):,.0f} | {d.get('checkpoints', 0):,.0f} | "
                    f"{d.get('relocate_microseconds', 0) / 1000:,.0f} ms | "
                    f"{d.get('checkpoint_microseconds', 0) / 1000:,.0f} ms |")
if rows:
    p()
    p("## Shoal's log during each job (per node, from /metrics)")
    p()
    p("Syncs are group commits; the cleaner moves live blocks so emptied segments can be reused;")
    p("the last two columns are the time client writes were locked out by the cleaner's moves and by checkpoints.")
    p()
    p("| Job | Node | syncs | mean sync | blocks moved | segments cleaned | writes that waited | checkpoints | locked: moves | locked: checkpoints |")
    p("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p(r)

def disk(job, t):
    """What the disk did during one fio run (ramp included), from the
    /proc/diskstats counters recorded before and after it."""
    f = os.path.join(out, f"{job}__{t}.disk")
    if not os.path.exists(f):
        return None
    rows = [l.split() for l in open(f) if l.strip()]
    if len(rows) != 2 or len(rows[0]) < 12 or len(rows[0]) != len(rows[1]):
        return None
    a, b = [[int(x) for x in r] for r in rows]
    d = [y - x for x, y in zip(a, b)]
    secs = d[0] / 1e9
    if secs <= 0:
        return None
    # fields after the time: reads, merged, sectors, ms, writes, merged,
    # sectors, ms, in flight, io ms, weighted ms, [discards x4], [flushes, ms]
    flushes = d[16] if len(d) >= 18 else None
    # An fdatasync reaches the disk as an empty write carrying the flush,
    # counted with the writes: those are taken out, so writes/s and the
    # write size are the writes that carry data.
    w = max(d[5] - (flushes or 0), 0)
    r = {"r_s": d[1] / secs, "r_await": d[4] / d[1] if d[1] else None,
         "w_s": w / secs, "w_await": d[8] / d[5] if d[5] else None,
         "wkib": d[7] / 2 / w if w else 0, "qd": d[11] / 1000 / secs,
         "f_s": None, "f_await": None}
    if flushes is not None:
        r["f_s"] = flushes / secs
        r["f_await"] = d[17] / flushes if flushes else None
    return r


def ms(x):
    return "–" if x is None else f"{x:.2f} ms"


drows = []
for j, label, kind in jobs:
    for t in targets:
        r = disk(j, t)
        if r is None:
            continue
        flushes = "–" if r["f_s"] is None else f"{r['f_s']:,.0f}"
        drows.append(f"| {j} | {t} | {r['r_s']:,.0f} | {ms(r['r_await'])} | {r['w_s']:,.0f} | "
                     f"{r['wkib']:,.0f} KiB | {ms(r['w_await'])} | {flushes} | "
                     f"{ms(r['f_await'])} | {r['qd']:.1f} |")
if drows:
    p()
    p("## The disk during each job (/proc/diskstats, ramp included)")
    p()
    p("All three targets share this disk. Queue depth is the mean number of requests the disk")
    p("held: a target that keeps fewer reads there than the raw file gets fewer IOPS from it.")
    p("Writes are those carrying data (an fdatasync's empty write is counted under flushes);")
    p("nbdkit's file plugin writes to the page cache, so its rows show little or no disk work.")
    p()
    p("| Job | Target | reads/s | read await | writes/s | write size | write await | flushes/s | flush await | queue depth |")
    p("|---|---|---|---|---|---|---|---|---|---|")
    for r in drows:
        p(r)

notes = os.path.join(out, "notes.txt")
if os.path.exists(notes):
    p()
    p("## Notes")
    for line in open(notes):
        p(f"- {line.strip()}")
PY
}

QUICK=0
REPORT_ONLY=""
while [ $# -gt 0 ]; do
  a="$1"; shift
  case "$a" in
    --quick) QUICK=1 ;;
    --report) REPORT_ONLY="${1:?--report needs a results folder}"; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $a (try --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$REPORT_ONLY" ]; then
  report "$REPORT_ONLY"; cat "$REPORT_ONLY/table.md"; exit 0
fi

if [ "$QUICK" = 1 ]; then
  RUNTIME="${RUNTIME:-5}"; RAMP="${RAMP:-1}"
else
  RUNTIME="${RUNTIME:-15}"; RAMP="${RAMP:-3}"
fi
BENCH_DIR="${BENCH_DIR:-$REPO/bench/results/work}"
RESULTS_ROOT="${RESULTS_ROOT:-$REPO/bench/results}"
SIZE="${SIZE:-2G}"
DEVICE_SIZE="${DEVICE_SIZE:-4G}"
THICK="${THICK:-1}"
ENCRYPT="${ENCRYPT:-0}"
POLICY="${POLICY:-raid1 ftt=1}"
NET="${NET:-127.0.50}"
NBD_PORT="${NBD_PORT:-10809}"
NBDKIT_ADDR="${NBDKIT_ADDR:-127.0.0.1}"
NBDKIT_PORT="${NBDKIT_PORT:-10859}"
TARGETS="${TARGETS:-shoal nbdkit raw}"
TRANSPORT="${TRANSPORT:-unix}"
EXTRA="${EXTRA:-0}"
INTERLEAVE="${INTERLEAVE:-0}"
SHOAL_BIN="${SHOAL_BIN:-$REPO/target/release/shoal}"
SKIP_BUILD="${SKIP_BUILD:-0}"
KEEP="${KEEP:-0}"
FIO_TIMEOUT_SLACK="${FIO_TIMEOUT_SLACK:-120}"
PREFILL_TIMEOUT="${PREFILL_TIMEOUT:-900}"

mkdir -p "$BENCH_DIR" "$RESULTS_ROOT"
BENCH_DIR="$(cd "$BENCH_DIR" && pwd)"
OUT="$RESULTS_ROOT/$(date +%Y%m%d-%H%M%S)"
mkdir -p "$OUT"

SHOAL_DATA="$BENCH_DIR/shoal"
RAW_FILE="$BENCH_DIR/raw.img"
NBDKIT_FILE="$BENCH_DIR/nbdkit.img"
NBDKIT_SOCK="$BENCH_DIR/nbdkit.sock"
case "$TRANSPORT" in
  unix)
    SHOAL_URI="nbd+unix:///bench?socket=$SHOAL_DATA/node1/nbd.sock"
    NBDKIT_URI="nbd+unix:///?socket=$NBDKIT_SOCK" ;;
  tcp)
    SHOAL_URI="nbd://$NET.1:$NBD_PORT/bench"
    NBDKIT_URI="nbd://$NBDKIT_ADDR:$NBDKIT_PORT/" ;;
  *) echo "TRANSPORT must be unix or tcp" >&2; exit 2 ;;
esac

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
note() { printf '%s\n' "$*" >>"$OUT/notes.txt"; log "note: $*"; }
has_target() { [[ " $TARGETS " == *" $1 "* ]]; }

# ---------------------------------------------------------------- cleanup
NBDKIT_PID=""
SHOAL_STARTED=0
cleanup() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  if [ -n "$NBDKIT_PID" ] && kill -0 "$NBDKIT_PID" 2>/dev/null; then
    log "stopping nbdkit (pid $NBDKIT_PID)"
    kill "$NBDKIT_PID"; wait "$NBDKIT_PID" 2>/dev/null
  fi
  if [ "$SHOAL_STARTED" = 1 ] && [ -f "$SHOAL_DATA/cluster.json" ]; then
    log "stopping the Shoal cluster"
    "$SHOAL_BIN" down --data "$SHOAL_DATA" >>"$OUT/shoal-down.log" 2>&1
  fi
  # Keep the tail of each node's log with the results.
  for f in "$SHOAL_DATA"/node*/node.log; do
    [ -f "$f" ] || continue
    tail -n 3000 "$f" >"$OUT/$(basename "$(dirname "$f")").log.tail"
  done
  if [ "$KEEP" != 1 ]; then
    rm -f "$RAW_FILE" "$NBDKIT_FILE" "$BENCH_DIR/uring-probe.img"
    rm -rf "$SHOAL_DATA"
    rmdir "$BENCH_DIR" 2>/dev/null
  else
    log "KEEP=1: leaving $BENCH_DIR in place"
  fi
  if [ "$rc" != 0 ]; then log "failed (exit $rc); partial results in $OUT"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- checks
for t in $TARGETS; do
  case "$t" in shoal|nbdkit|raw) ;; *) echo "unknown target: $t" >&2; exit 2 ;; esac
done
command -v fio >/dev/null || { echo "fio is required (apt-get install fio)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is required" >&2; exit 1; }
if has_target nbdkit; then
  command -v nbdkit >/dev/null || { echo "nbdkit is required (apt-get install nbdkit)" >&2; exit 1; }
fi
if ! fio --enghelp 2>/dev/null | grep -qw nbd; then
  echo "this fio has no nbd engine (Debian's fio has it)" >&2; exit 1
fi
size_bytes() { python3 -c '
import sys; s=sys.argv[1].strip().upper(); m={"K":1<<10,"M":1<<20,"G":1<<30,"T":1<<40}
print(int(float(s[:-1])*m[s[-1]]) if s[-1] in m else int(s))' "$1"; }
SIZE_B="$(size_bytes "$SIZE")"
need=$(( SIZE_B * 5 + (1 << 30) ))   # raw + nbdkit + 2 Shoal copies + slack
avail=$(( $(df -Pk "$BENCH_DIR" | awk 'NR==2{print $4}') * 1024 ))
if [ "$avail" -lt "$need" ]; then
  echo "not enough space in $BENCH_DIR: $((avail>>30)) GiB free, ~$((need>>30)) GiB needed" >&2; exit 1
fi

if has_target shoal; then
  if [ "$SKIP_BUILD" != 1 ]; then
    log "cargo build --release -p shoal-cli"
    cargo build --release -p shoal-cli >"$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log" >&2; exit 1; }
  fi
  [ -x "$SHOAL_BIN" ] || { echo "no shoal binary at $SHOAL_BIN" >&2; exit 1; }
fi

{
  echo "date: $(date -Is)"
  echo "host: $(uname -srm), $(nproc) cores"
  echo "fio: $(fio --version)"
  command -v nbdkit >/dev/null && echo "nbdkit: $(nbdkit --version | head -1)"
  has_target shoal && echo "shoal: $("$SHOAL_BIN" --version)"
  echo "disk: $(df -Ph "$BENCH_DIR" | awk 'NR==2{print $1" ("$2", mounted on "$6")"}')"
  echo "BENCH_DIR=$BENCH_DIR SIZE=$SIZE RUNTIME=$RUNTIME RAMP=$RAMP TARGETS=\"$TARGETS\" EXTRA=$EXTRA INTERLEAVE=$INTERLEAVE TRANSPORT=$TRANSPORT"
} >"$OUT/env.txt"

# ---------------------------------------------------------------- fio
# run_fio NAME TIMEOUT ARGS... : writes $OUT/NAME.json (clean JSON) and
# $OUT/NAME.err; returns non-zero if fio failed or reported an error.
run_fio() {
  local name="$1" to="$2"; shift 2
  printf 'fio %s\n' "$*" >"$OUT/$name.cmd"
  local rc=0
  disk_snap >"$OUT/$name.disk"
  timeout --kill-after=10 "$to" fio --output-format=json "$@" >"$OUT/$name.raw" 2>"$OUT/$name.err" || rc=$?
  disk_snap >>"$OUT/$name.disk"
  # The nbd engine prints "fio: connected to NBD server" before the JSON.
  local pyrc=0
  python3 - "$OUT/$name.raw" "$OUT/$name.json" <<'PY' || pyrc=$?
import json, sys
s = open(sys.argv[1]).read()
i = s.find("\n{") + 1 if not s.startswith("{") else 0
if not s.startswith("{") and i == 0:
    sys.exit(1)
d = json.loads(s[i:])
json.dump(d, open(sys.argv[2], "w"), indent=1)
sys.exit(1 if any(j.get("error") for j in d.get("jobs", [])) else 0)
PY
  [ "$pyrc" = 0 ] || [ "$rc" != 0 ] || rc=1
  rm -f "$OUT/$name.raw"
  if [ "$rc" != 0 ]; then
    echo "$rc" >"$OUT/$name.failed"
    log "fio $name failed (rc $rc): $(tail -n 3 "$OUT/$name.err" | tr '\n' ' ')"
    [ "$rc" = 124 ] && note "$name: fio did not finish within ${to}s and was killed (stall?)"
    return 1
  fi
}

# The disk under BENCH_DIR (all three targets use it), as /proc/diskstats
# names it: each fio run records its counters before and after, and the
# report shows what the disk did (queue depth, awaits, flushes).
DISK=""
if src=$(df --output=source "$BENCH_DIR" 2>/dev/null | tail -n 1) && [ -b "$src" ]; then
  DISK=$(basename "$(readlink -f "$src")")
  grep -qw "$DISK" /proc/diskstats || DISK=""
fi
# disk_snap: "NANOSECONDS DISKSTATS-FIELDS..." of $DISK (nothing if unknown).
disk_snap() {
  [ -n "$DISK" ] || return 0
  awk -v d="$DISK" -v t="$(date +%s%N)" '$3 == d { $1 = t; $2 = ""; $3 = ""; print; exit }' /proc/diskstats
}

TIMED=(--time_based "--runtime=$RUNTIME" "--ramp_time=$RAMP")
FIO_TO=$(( RUNTIME + RAMP + FIO_TIMEOUT_SLACK ))
RAND=(--norandommap --randrepeat=0)

# engine args per target
target_args() {
  case "$1" in
    shoal)  echo "--ioengine=nbd --uri=$SHOAL_URI" ;;
    nbdkit) echo "--ioengine=nbd --uri=$NBDKIT_URI" ;;
    raw)    echo "--ioengine=$RAW_ENGINE --direct=1 --filename=$RAW_FILE" ;;
  esac
}

# The durable-QD1 option per target (set after the probes below).
SYNC_SHOAL=""            # Shoal acks a write only once it is durable on every copy
SYNC_NBDKIT="--fdatasync=1"
SYNC_RAW="--fdatasync=1"
sync_opt() { case "$1" in shoal) echo "$SYNC_SHOAL" ;; nbdkit) echo "$SYNC_NBDKIT" ;; raw) echo "$SYNC_RAW" ;; esac; }

JOBS_IN_ORDER="prefill rw4k_qd32 rw4k_qd1 rr4k_qd32 sw1m_qd8"

run_job() { # run_job TARGET JOB
  local t="$1" job="$2" ta; read -r -a ta <<<"$(target_args "$t")"
  local common=(--size="$SIZE" "${ta[@]}")
  case "$job" in
  prefill)
    log "[$t] prefill: 1M sequential write of $SIZE, QD8"
    run_fio "prefill__$t" "$PREFILL_TIMEOUT" --name=prefill --rw=write --bs=1M --iodepth=8 "${common[@]}" || true ;;
  rw4k_qd32)
    log "[$t] 4K random write QD32"
    run_fio "rw4k_qd32__$t" "$FIO_TO" --name=rw4k_qd32 --rw=randwrite --bs=4k --iodepth=32 "${RAND[@]}" "${TIMED[@]}" "${common[@]}" || true ;;
  rw4k_qd1)
    local so; so="$(sync_opt "$t")"
    log "[$t] 4K random write QD1 durable ${so:-(no sync option: every ack is durable)}"
    # shellcheck disable=SC2086
    run_fio "rw4k_qd1__$t" "$FIO_TO" --name=rw4k_qd1 --rw=randwrite --bs=4k --iodepth=1 $so "${RAND[@]}" "${TIMED[@]}" "${common[@]}" || true
    if [ "$EXTRA" = 1 ]; then
      if [ "$t" = shoal ]; then
        log "[$t] (extra) 4K random write QD1 + NBD flush after each write"
        run_fio "rw4k_qd1x__$t" "$FIO_TO" --name=rw4k_qd1x --rw=randwrite --bs=4k --iodepth=1 --fsync=1 "${RAND[@]}" "${TIMED[@]}" "${common[@]}" || true
      else
        log "[$t] (extra) 4K random write QD1 without sync"
        run_fio "rw4k_qd1x__$t" "$FIO_TO" --name=rw4k_qd1x --rw=randwrite --bs=4k --iodepth=1 "${RAND[@]}" "${TIMED[@]}" "${common[@]}" || true
      fi
    fi ;;
  rr4k_qd32)
    log "[$t] 4K random read QD32"
    run_fio "rr4k_qd32__$t" "$FIO_TO" --name=rr4k_qd32 --rw=randread --bs=4k --iodepth=32 "${RAND[@]}" "${TIMED[@]}" "${common[@]}" || true ;;
  sw1m_qd8)
    log "[$t] 1M sequential write QD8"
    run_fio "sw1m_qd8__$t" "$FIO_TO" --name=sw1m_qd8 --rw=write --bs=1M --iodepth=8 "${TIMED[@]}" "${common[@]}" || true ;;
  esac
}

# scrape_log_metrics FILE: the Shoal nodes' per-device log counters (syncs,
# cleaner, checkpoints), one "node metric value" line each.
scrape_log_metrics() {
  local n token
  # /metrics needs a token: the cluster's admin token, as `shoal up` wrote it.
  token=$(cat "$SHOAL_DATA/admin.token" 2>/dev/null || true)
  for n in 1 2 3 4; do
    curl -s --max-time 3 -H "Authorization: Bearer $token" "http://$NET.$n:9400/metrics" 2>/dev/null \
      | grep -E '^shoal_device_(syncs|sync_microseconds|cleaner_blocks|cleaned_segments|cleaner_waits|checkpoints|checkpoint_microseconds|relocate_microseconds)_total' \
      | awk -v n="$n" '{ sub(/\{.*\}/, "", $1); s[$1] += $2 } END { for (k in s) print n, k, s[k] }'
  done >"$1" || true
}

run_jobs() { # run_jobs TARGET: every job, in order, on one target
  local job
  for job in $JOBS_IN_ORDER; do
    # Shoal's own log work during each job (the report sums it up).
    if [ "$1" = shoal ]; then scrape_log_metrics "$OUT/${job}__shoal.log-before"; fi
    run_job "$1" "$job"
    if [ "$1" = shoal ]; then scrape_log_metrics "$OUT/${job}__shoal.log-after"; fi
  done
}

# Targets that are set up (INTERLEAVE=1 runs them after all are up).
READY_TARGETS=""
defer_or_run() { # defer_or_run TARGET
  if [ "$INTERLEAVE" = 1 ]; then READY_TARGETS="$READY_TARGETS $1"; else run_jobs "$1"; fi
}

# ---------------------------------------------------------------- A: Shoal
finish_shoal() {
  "$SHOAL_BIN" status --data "$SHOAL_DATA" >"$OUT/shoal-status-after.txt" 2>&1 || true
  "$SHOAL_BIN" volume verify bench --data "$SHOAL_DATA" >"$OUT/shoal-verify.txt" 2>&1 \
    || note "shoal volume verify bench failed after the run: $(tail -n 1 "$OUT/shoal-verify.txt")"
}

stop_shoal() {
  log "[shoal] stopping the cluster"
  "$SHOAL_BIN" down --data "$SHOAL_DATA" >>"$OUT/shoal-down.log" 2>&1 || true
  SHOAL_STARTED=0
  if [ "$KEEP" != 1 ]; then
    for f in "$SHOAL_DATA"/node*/node.log; do
      if [ -f "$f" ]; then tail -n 3000 "$f" >"$OUT/$(basename "$(dirname "$f")").log.tail"; fi
    done
    rm -rf "$SHOAL_DATA"
  fi
}

if has_target shoal; then
  if [ -f "$SHOAL_DATA/cluster.json" ]; then
    log "a cluster from an earlier run is in $SHOAL_DATA: stopping and removing it"
    "$SHOAL_BIN" down --data "$SHOAL_DATA" >/dev/null 2>&1 || true
  fi
  rm -rf "$SHOAL_DATA"
  log "[shoal] starting 4 nodes on $NET.1-4"
  SHOAL_STARTED=1
  shoal_ready=0
  if ! "$SHOAL_BIN" up --data "$SHOAL_DATA" --nodes 4 --net "$NET" --nbd-port "$NBD_PORT" \
        --device-size "$DEVICE_SIZE" $([ "$THICK" = 1 ] && echo --thick) \
        $([ "$ENCRYPT" = 1 ] && echo --encrypt-in-transit) --no-demo \
        >"$OUT/shoal-up.log" 2>&1; then
    cat "$OUT/shoal-up.log" >&2
    note "shoal up failed; Shoal cells are empty"
  elif ! "$SHOAL_BIN" volume create bench --size "$SIZE" --policy "$POLICY" \
        --data "$SHOAL_DATA" >"$OUT/shoal-volume.log" 2>&1; then
    cat "$OUT/shoal-volume.log" >&2
    note "shoal volume create failed; Shoal cells are empty"
  else
    for _ in $(seq 1 120); do
      if nbdinfo --size "$SHOAL_URI" >/dev/null 2>&1 || \
         fio --name=probe --ioengine=nbd --uri="$SHOAL_URI" --rw=read --bs=4k --size=4k >/dev/null 2>&1; then
        shoal_ready=1; break
      fi
      sleep 0.5
    done
    if [ "$shoal_ready" = 1 ]; then
      "$SHOAL_BIN" status --data "$SHOAL_DATA" >"$OUT/shoal-status-before.txt" 2>&1 || true
      defer_or_run shoal
      [ "$INTERLEAVE" = 1 ] || finish_shoal
    else
      note "the Shoal export $SHOAL_URI did not answer within 60s; Shoal cells are empty"
    fi
  fi
  if [ "$INTERLEAVE" != 1 ] || [ "$shoal_ready" != 1 ]; then stop_shoal; fi
fi

# ---------------------------------------------------------------- B: nbdkit
stop_nbdkit() {
  if [ -n "$NBDKIT_PID" ]; then kill "$NBDKIT_PID" 2>/dev/null || true; wait "$NBDKIT_PID" 2>/dev/null || true; NBDKIT_PID=""; fi
  [ "$KEEP" = 1 ] || rm -f "$NBDKIT_FILE"
}

if has_target nbdkit; then
  rm -f "$NBDKIT_FILE"
  truncate -s "$SIZE" "$NBDKIT_FILE"
  log "[nbdkit] serving $NBDKIT_FILE at $NBDKIT_URI"
  if [ "$TRANSPORT" = unix ]; then
    rm -f "$NBDKIT_SOCK"
    nbdkit -f -U "$NBDKIT_SOCK" file "$NBDKIT_FILE" >"$OUT/nbdkit.log" 2>&1 &
  else
    nbdkit -f -i "$NBDKIT_ADDR" -p "$NBDKIT_PORT" file "$NBDKIT_FILE" >"$OUT/nbdkit.log" 2>&1 &
  fi
  NBDKIT_PID=$!
  ready=0
  for _ in $(seq 1 50); do
    if nbdinfo --size "$NBDKIT_URI" >/dev/null 2>&1; then ready=1; break; fi
    kill -0 "$NBDKIT_PID" 2>/dev/null || break
    sleep 0.2
  done
  if [ "$ready" = 1 ]; then
    # fio's nbd engine answers --fdatasync with EINVAL (it only maps
    # --fsync to NBD_CMD_FLUSH): probe, and use --fsync=1 if so.
    if ! fio --name=probe --ioengine=nbd --uri="$NBDKIT_URI" --rw=randwrite --bs=4k --size=4M \
          --io_size=64k --fdatasync=1 >/dev/null 2>&1; then
      SYNC_NBDKIT="--fsync=1"
      note "nbdkit QD1: fio's nbd engine refuses --fdatasync (EINVAL); used --fsync=1, which sends NBD_CMD_FLUSH (nbdkit's file plugin then fdatasyncs) after each write"
    fi
    defer_or_run nbdkit
  else
    note "nbdkit did not start (see nbdkit.log); nbdkit cells are empty"
  fi
  if [ "$INTERLEAVE" != 1 ] || [ "$ready" != 1 ]; then stop_nbdkit; fi
fi

# ---------------------------------------------------------------- C: raw file
RAW_ENGINE=io_uring
if has_target raw; then
  if ! fio --name=probe --filename="$BENCH_DIR/uring-probe.img" --size=16M --ioengine=io_uring --direct=1 \
        --rw=randwrite --bs=4k --iodepth=4 --io_size=1M >"$OUT/uring-probe.log" 2>&1; then
    RAW_ENGINE=libaio
    note "io_uring was refused (see uring-probe.log); the raw file used --ioengine=libaio"
  fi
  rm -f "$BENCH_DIR/uring-probe.img"
  rm -f "$RAW_FILE"   # fio lays it out during the prefill
  defer_or_run raw
  if [ "$INTERLEAVE" != 1 ]; then [ "$KEEP" = 1 ] || rm -f "$RAW_FILE"; fi
fi

# ---------------------------------------------------------------- interleaved
# Every job on every target before the next job: the ratios of one job
# come from runs a minute apart, not a quarter of an hour (the disk's pace
# drifts that much). Dirty pages of one target are written back (`sync`)
# before the next target's run, so none pays for another's writes.
if [ "$INTERLEAVE" = 1 ]; then
  for job in $JOBS_IN_ORDER; do
    for t in $READY_TARGETS; do
      sync
      run_job "$t" "$job"
    done
  done
  for t in $READY_TARGETS; do
    case "$t" in
      shoal) finish_shoal; stop_shoal ;;
      nbdkit) stop_nbdkit ;;
      raw) [ "$KEEP" = 1 ] || rm -f "$RAW_FILE" ;;
    esac
  done
fi
echo "$RAW_ENGINE" >"$OUT/raw-engine.txt"
echo "$RAW_ENGINE $SYNC_NBDKIT $EXTRA $SIZE $RUNTIME $RAMP $TRANSPORT $INTERLEAVE" >"$OUT/report-args"
report "$OUT"


cat "$OUT/table.md"
echo
echo "results: $OUT"
