#!/usr/bin/env bash
# Store-alone benchmark: shoal-store's LogStore (examples/store_bench.rs) vs
# fio (io_uring, O_DIRECT) on a plain file of the same file system, same
# queue depth, same durability. Prints a Markdown table of medians.
#
#   bench/store.sh                    # 3 rounds, 10 s runs + 2 s ramp
#   RUNS=5 RUNTIME=20 bench/store.sh
#   JOBS="4k-randread 512k-seqread-scattered" bench/store.sh
#   bench/store.sh --report DIR       # re-print a table from saved results
#
# Settings (environment): BENCH_DIR (default /work/bench-store: the store's
# device file and fio's file, both removed at the end unless KEEP=1), SIZE
# (store device, default 4G, written in full like fio's file; THICK=0 keeps
# it sparse), SPAN (component / fio file, default 2G),
# RUNS, RUNTIME, RAMP, JOBS, RECOVERY=0 to skip the recovery measurement,
# RECOVERY_GIB (default 1).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"

report_only=""
if [[ "${1:-}" == "--report" ]]; then
    report_only="${2:?--report DIR}"
fi
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then
    sed -n '2,16p' "$0"
    exit 0
fi

BENCH_DIR="${BENCH_DIR:-/work/bench-store}"
SIZE="${SIZE:-4G}"
SPAN="${SPAN:-2G}"
RUNS="${RUNS:-3}"
RUNTIME="${RUNTIME:-10}"
RAMP="${RAMP:-2}"
JOBS="${JOBS:-4k-randwrite 4k-randwrite-pipeline 4k-randread 4k-randread-ring 1m-seqwrite 512k-seqread-scattered}"
RECOVERY="${RECOVERY:-1}"
RECOVERY_GIB="${RECOVERY_GIB:-1}"
KEEP="${KEEP:-0}"
THICK="${THICK:-1}"

# job -> "store args|fio args|target ratio|metric"
# Durability: the store acknowledges a write after its group commit, so
# each store thread does write + commit_blocking; fio runs --fdatasync=N
# with N = the queue depth: one fdatasync per QD writes, the most writes a
# group commit at that depth can ever share (the store measures fewer per
# flush, ~16 at QD32: see writes_per_flush). So fio gets the cheapest
# durability the store could reach, never a cheaper one.
# Two drivers of the store for 4K random writes: `4k-randwrite` is 32
# threads each blocking in commit_blocking (a thread wake-up per write:
# ~15 writes a flush); `4k-randwrite-pipeline` drives it the node's way,
# one thread applying writes and keeping 32 in flight, one flusher thread
# syncing (32 writes a flush, the same durability as fio's here).
job_spec() {
    case "$1" in
    4k-randwrite) echo "randwrite --bs 4k --qd 32|--rw=randwrite --bs=4k --iodepth=32 --fdatasync=32|0.80|iops" ;;
    4k-randwrite-pipeline) echo "randwrite --bs 4k --qd 32 --driver pipeline|--rw=randwrite --bs=4k --iodepth=32 --fdatasync=32|0.80|iops" ;;
    4k-randread) echo "randread --bs 4k --qd 32 --fill seq|--rw=randread --bs=4k --iodepth=32|0.80|iops" ;;
    4k-randread-ring) echo "randread --bs 4k --qd 32 --fill seq --driver ring|--rw=randread --bs=4k --iodepth=32|0.80|iops" ;;
    1m-seqwrite) echo "seqwrite --bs 1M --qd 8|--rw=write --bs=1M --iodepth=8 --fdatasync=8|0.90|mib_s" ;;
    512k-seqread-scattered) echo "seqread --bs 512k --qd 8 --fill random --span 1G|--rw=read --bs=512k --iodepth=8|-|mib_s" ;;
    *) echo "unknown job $1" >&2; exit 2 ;;
    esac
}

print_table() {
    python3 - "$1" <<'EOF'
import json, os, sys, statistics, glob
d = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(d, "*.json"))):
    name = os.path.basename(f)[:-5]
    job, target, run = name.rsplit("__", 2)
    try:
        j = json.load(open(f))
    except Exception:
        continue
    if target == "fio":
        jj = j["jobs"][0]
        io = jj["write"] if jj["write"]["io_bytes"] > 0 else jj["read"]
        v = {"iops": io["iops"], "mib_s": io["bw"] / 1024.0,
             "lat": io["clat_ns"]["mean"] / 1000.0}
    elif target == "store":
        v = {"iops": j["iops"], "mib_s": j["mib_s"], "lat": j["lat_us_mean"],
             "wpf": j.get("writes_per_flush")}
    else:
        v = j
    rows.setdefault(job, {}).setdefault(target, []).append(v)
spec = {"4k-randwrite": ("iops", 0.80), "4k-randwrite-pipeline": ("iops", 0.80), "4k-randread": ("iops", 0.80), "4k-randread-ring": ("iops", 0.80),
        "1m-seqwrite": ("mib_s", 0.90), "512k-seqread-scattered": ("mib_s", None)}
med = lambda xs: statistics.median(xs) if xs else float("nan")
print("| job | store | fio | store/fio | target | met | runs | store writes/flush |")
print("|---|---:|---:|---:|---:|---|---:|---:|")
for job in [j for j in spec if j in rows]:
    metric, tgt = spec[job]
    s = rows[job].get("store", []); f = rows[job].get("fio", [])
    sv = med([x[metric] for x in s]); fv = med([x[metric] for x in f])
    unit = "IOPS" if metric == "iops" else "MiB/s"
    ratio = sv / fv if fv else float("nan")
    wpf = [x["wpf"] for x in s if x.get("wpf")]
    print(f"| {job} | {sv:,.0f} {unit} | {fv:,.0f} {unit} | {ratio:.2f} | "
          f"{'≥ %.2f' % tgt if tgt else '-'} | {('yes' if ratio >= tgt else 'NO') if tgt else '-'} | "
          f"{min(len(s), len(f))} | {('%.1f' % med(wpf)) if wpf else '-'} |")
rec = rows.get("recovery", {})
for k, xs in sorted(rec.items()):
    print(f"\nrecovery ({k}), medians of {len(xs)}: open {med([x['open_s'] for x in xs]):.2f} s, "
          f"replayed {med([x['replayed_gib'] for x in xs]):.3f} GiB, "
          f"{med([x['s_per_gib_replayed'] for x in xs]):.2f} s per GiB replayed")
EOF
}

if [[ -n "$report_only" ]]; then
    print_table "$report_only"
    exit 0
fi

command -v fio >/dev/null || { echo "fio is needed (apt-get install fio)" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is needed" >&2; exit 1; }

cd "$root"
cargo build --release -p shoal-store --example store_bench >&2
bin="${CARGO_TARGET_DIR:-$root/target}/release/examples/store_bench"

mkdir -p "$BENCH_DIR"
out="$here/results/store-$(date +%Y%m%d-%H%M%S)"
mkdir -p "$out"
img="$BENCH_DIR/store.img"
fimg="$BENCH_DIR/fio.img"
cleanup() {
    if [[ "$KEEP" != 1 ]]; then rm -f "$img" "$fimg"; fi
}
trap cleanup EXIT

{
    echo "date: $(date -Is)"
    echo "kernel: $(uname -r)"
    echo "cpus: $(nproc)"
    echo "fs: $(df -T "$BENCH_DIR" | tail -1)"
    echo "fio: $(fio --version)"
    echo "git: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "settings: SIZE=$SIZE SPAN=$SPAN RUNS=$RUNS RUNTIME=$RUNTIME RAMP=$RAMP THICK=$THICK"
} >"$out/env.txt"

for run in $(seq 1 "$RUNS"); do
    for job in $JOBS; do
        IFS='|' read -r sargs fargs _ _ <<<"$(job_spec "$job")"
        echo "run $run/$RUNS: $job (store)" >&2
        mode="${sargs%% *}"
        rest="${sargs#* }"
        keep=()
        if [[ "$THICK" == 1 ]]; then
            # Written in full like fio's laid-out file: no block allocation
            # in the file system on the data path (the store keeps it thick).
            rm -f "$img"
            dd if=/dev/zero of="$img" bs=8M count=$(( $(numfmt --from=iec "$SIZE") / 8388608 )) \
                conv=fsync status=none
            keep=(--keep)
        fi
        # The job's own options come last, so its --span wins.
        # shellcheck disable=SC2086
        "$bin" "$mode" --file "$img" --size "$SIZE" --span "$SPAN" "${keep[@]}" \
            --runtime "$RUNTIME" --ramp "$RAMP" $rest \
            >"$out/${job}__store__${run}.json" 2>>"$out/store.log" || true
        rm -f "$img"
        fspan="$SPAN"
        [[ "$sargs" =~ --span\ ([^ ]+) ]] && fspan="${BASH_REMATCH[1]}"
        echo "run $run/$RUNS: $job (fio)" >&2
        # shellcheck disable=SC2086
        fio --name="$job" --filename="$fimg" --size="$fspan" --ioengine=io_uring --direct=1 \
            $fargs --runtime="$RUNTIME" --ramp_time="$RAMP" --time_based \
            --output-format=json >"$out/${job}__fio__${run}.json" 2>>"$out/fio.log" || true
    done
    if [[ "$RECOVERY" == 1 ]]; then
        echo "run $run/$RUNS: recovery" >&2
        "$bin" recovery --file "$img" --size "$SIZE" --span "$SPAN" --bs 4k --qd 32 \
            --gib "$RECOVERY_GIB" >"$out/recovery__default__$run.json" 2>>"$out/store.log" || true
        "$bin" recovery --file "$img" --size "$SIZE" --span "$SPAN" --bs 4k --qd 32 \
            --gib "$RECOVERY_GIB" --no-ckpt >"$out/recovery__no-ckpt__$run.json" 2>>"$out/store.log" || true
        rm -f "$img"
    fi
done

print_table "$out" | tee "$out/table.md"
echo "results: $out" >&2
