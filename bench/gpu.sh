#!/usr/bin/env bash
# The device check of the GPU-path issue (16) as one prepared script, run from the repo root
# on the device machine as-is, a GPU (dask-cuda) or a TPU (a threads cluster: one process
# holds the chip, so the learner and the collectors are Dask workers as threads of it):
#
#   bash bench/gpu.sh          # the device tool's call, with carry [".whl"] or [".whl-tpu"]
#
# It installs what the machine lacks from the wheels carried in .whl/ or .whl-tpu/ (ignored
# by git; ../shared/notes/gpu.md and BENCHMARKS.md say which), then measures, most important
# first, each part under its own time limit inside one overall budget (parts the budget no
# longer covers are skipped and say so): disk MB/s (dd, fdatasync); store region write MB/s
# against raw tofile + fsync of the same bytes (bench/write_throughput.py); plain rollout vs
# the collect stage at N = 65,536 / 1,024 / 8,192 (bench/collect_throughput.py, serial and
# streamed); the whole MAPPO loop through the stages vs the plain fused loop; learner
# updates/s per preset; the QMIX and MADDPG loops (bench/gpu_check.py); and, asked for by name,
# "compile": trace, compile, first and steady call of each env family's rollout, apart
# (bench/compile_probe.py), and "hostcopy": how fast a region leaves the device
# (bench/host_copy.py); and "maps": SMAX learning runs of bench/smax_maps.py on the accelerator
# (GPU_CHECK_MAPS_ARGS, its arguments, argument sets separated by ';' run one after another in
# run roots device, device2, ...; GPU_CHECK_MAPS_LIMIT_S, default 540, for all) with CPU-only runs
# beside it on the machine's other cores (GPU_CHECK_MAPS_CPU_ARGS, argument sets separated by
# ';'), each run's metrics.csv and wall log brought back in $OUT/maps-runs.tgz (read them here
# with `mkdir R && tar xzf maps-runs.tgz -C R && python bench/smax_maps.py --report-only
# --run-root R/device`, or R/cpu1 ...). The run roots stay in $GPU_CHECK_DIR, so a call on a
# machine still warm resumes its runs from their checkpoints. Measured on this 2-core CPU (GPU_CHECK_SIZE=small, the default
# parts, 2026-12-05): 98-107 s end to end. Results go to $OUT as three files, appended as they
# are measured: rows.jsonl (every row, tagged with its part), tables.md, log.txt (the
# benchmarks' own json/md/png go to $GPU_CHECK_DIR/gpu-check-results, never to bench/results).
#
# The wheels for a TPU machine (Python 3.11, JAX 0.10.2 already there; see BENCHMARKS.md, "The
# device check on a TPU v5e"): bench/device-wheels.txt, fetched here into the ignored .whl-tpu/ by
#   echo /.whl-tpu/ >> .git/info/exclude; xargs -a bench/device-wheels.txt python3 -m pip download
#     --no-deps --only-binary=:all: --python-version 3.11 --implementation cp
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl-tpu
# (46 MB; matplotlib comes from the machine's own index, /opt/pypi/simple).
# For the H200 machine (Python 3.12; jax, flax, optax, orbax there; ../shared/notes/gpu.md):
# bench/device-wheels-gpu.txt (27 MB), into the ignored .whl/ by the same command with
# --python-version 3.12, that list and -d .whl (echo /.whl/ >> .git/info/exclude first);
# carry [".whl"].
#
# Knobs (environment): OUT (default ./gpu-check-out), GPU_CHECK_SIZE=full|small (small: tiny
# sizes for a CPU dry run: CUDA_VISIBLE_DEVICES= GPU_CHECK_SIZE=small bash bench/gpu.sh),
# GPU_CHECK_BUDGET_S (default 360 full, 600 small), GPU_CHECK_PARTS (default "write collect
# loop:mappo learners loop:qmix loop:maddpg", run in that order), GPU_CHECK_COLLECT (the N to
# run, default all), GPU_CHECK_LAGS (default "0 1"), GPU_CHECK_OVERRIDES and GPU_CHECK_ENV_STEPS
# (the loops' settings and env-step budget, plain and stages alike), GPU_CHECK_WRITE_ARGS (the
# write part's bench/write_throughput.py arguments, as shell words, e.g. '--preset mappo-mpe
# --sizes 4096x128 --repeats 3 --variants "none, fsync"'), GPU_CHECK_PRESETS (the learners part's,
# default "qmix-smac mappo-mpe maddpg-mpe"), GPU_CHECK_PROBE_ARGS (the compile part's, default
# "--envs 4096 --case-timeout-s 50"), GPU_CHECK_HOSTCOPY_ARGS (the hostcopy part's, default
# "--envs 4096 --steps 128 --repeats 3"), GPU_CHECK_LOOP_LIMIT_S (each loop part's limit, default
# 200: QMIX's plain loop alone took 130 s on a TPU v5e, so give it 400), GPU_CHECK_LEARNERS_LIMIT_S
# (the learners part's limit, default 90; a TPU compiles SMAX's region for it), GPU_CHECK_PROFILE (1:
# each stages run of a loop part samples its threads' stacks, and tables.md gets
# bench/profile_summary.py's per-thread tables), PYTHON (default python3), GPU_CHECK_DIR (where
# stores are written, default $TMPDIR or /tmp).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
SIZE=${GPU_CHECK_SIZE:-full}
PY=${PYTHON:-python3}
DIR=${GPU_CHECK_DIR:-${TMPDIR:-/tmp}}
# which parts run, in this order (a rerun names the ones left); MAPPO's loop first among the
# loops (the issue's >= 0.8x target)
PARTS=${GPU_CHECK_PARTS:-write collect loop:mappo learners loop:qmix loop:maddpg}
PRESETS=${GPU_CHECK_PRESETS:-qmix-smac mappo-mpe maddpg-mpe}   # the learners part's presets
COLLECT_N=${GPU_CHECK_COLLECT:-}   # the collect sizes N to run (default: all of the size's)
LAGS=${GPU_CHECK_LAGS:-0 1}   # max_policy_lag of each stages run of a loop
LOOP_OVERRIDES=${GPU_CHECK_OVERRIDES:-}   # key=value settings of the loops, plain and stages alike (e.g. envs_per_collector=4096)
mkdir -p "$OUT" "$DIR"
LOG="$OUT/log.txt"
TABLES="$OUT/tables.md"
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # the driver and a Dask worker share the GPU
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$DIR/marl-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export MPLBACKEND=Agg
export MARL_BENCH_RESULTS=$DIR/gpu-check-results   # the benchmarks' own files, kept out of the repo and $OUT
RESULTS=$MARL_BENCH_RESULTS
BEGAN=$(date +%s)

case "$SIZE" in
  full)
    BUDGET=${GPU_CHECK_BUDGET_S:-360}
    DD_MB=2048
    WRITE=(--sizes 8192x32 65536x16 --repeats 2 1 --variants "store (zstd 1, fsync)" "zstd 0 (level 3), fsync"
           "blosc lz4 no shuffle, fsync" "none, fsync")
    COLLECT=("65536 16 2" "1024 32 8" "8192 32 4")   # envs, steps per region, repeats; the target's N first
    LEARN_S=5
    declare -A LOOP_STEPS=([mappo]=1000000 [qmix]=102400 [maddpg]=100000)
    PROBE_DEFAULT="--envs 4096 --case-timeout-s 50"
    HOSTCOPY_ARGS="--envs 4096 --steps 128 --repeats 3" ;;
  small)
    BUDGET=${GPU_CHECK_BUDGET_S:-600}
    DD_MB=128
    WRITE=(--sizes 32x32 128x32 --repeats 5 3 --variants "store (zstd 1, fsync)" "zstd 1, no fsync"
           "none, fsync" "previous (zstd 0, 1 chunk, scan, no fsync)")
    COLLECT=("64 16 3")
    LEARN_S=1
    declare -A LOOP_STEPS=([mappo]=32768 [qmix]=4096 [maddpg]=4000)
    PROBE_DEFAULT="--envs 16 --steps 8 --case-timeout-s 60"
    HOSTCOPY_ARGS="--envs 64 --steps 16 --repeats 2" ;;
  *) echo "GPU_CHECK_SIZE must be full or small, got '$SIZE'" >&2; exit 2 ;;
esac
[ -n "${GPU_CHECK_WRITE_ARGS:-}" ] && eval "WRITE=($GPU_CHECK_WRITE_ARGS)"   # the write part's arguments
PROBE_ARGS=${GPU_CHECK_PROBE_ARGS:-$PROBE_DEFAULT}   # bench/compile_probe.py's arguments (the compile part)
HOSTCOPY_ARGS=${GPU_CHECK_HOSTCOPY_ARGS:-$HOSTCOPY_ARGS}   # bench/host_copy.py's (the hostcopy part)

left() { echo $(( BUDGET - ($(date +%s) - BEGAN) )); }

# part NAME LIMIT_S CMD...: runs CMD under min(LIMIT_S, what is left of the budget), logs it,
# and notes its exit status (124: cut by its limit; the rows it wrote stay)
part() {
  local name=$1 limit=$2; shift 2
  local budget_left; budget_left=$(left)
  (( budget_left < limit )) && limit=$budget_left
  if (( limit < 10 )); then
    echo "| $name | skipped: budget spent |" >> "$OUT/status.md.tmp"; return
  fi
  # a TPU chip can refuse a program started just after another let it go
  [ -n "${TPU:-}" ] && sleep 4
  echo "=== $name (limit ${limit}s, $(date -u +%H:%M:%S)) ===" >> "$LOG"
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "| $name | exit $rc after $(( $(date +%s) - t0 )) s (limit ${limit}s) |" >> "$OUT/status.md.tmp"
}

{
  echo "# marl-dataflow device check ($SIZE), $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
} > "$TABLES"
: > "$OUT/status.md.tmp"

# ---------------------------------------------------------------- what the machine lacks
if ! "$PY" -c "import zarr, numcodecs, dask, distributed, jaxmarl" 2>/dev/null; then
  WHEELS=$(ls -d .whl .whl-tpu 2>/dev/null | head -1)
  if [ -n "$WHEELS" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    # none of the wheels is JAX: the machine's own JAX (and its accelerator plugin) stays
    PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --isolated --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl >> "$LOG" 2>&1 || { echo "wheel install failed, see $LOG" >&2; exit 2; }
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}:/tmp/site
    # the plots only; a TPU machine's own index has matplotlib (kept out of .whl-tpu for size)
    if ! "$PY" -c "import matplotlib" 2>/dev/null && [ -d /opt/pypi/simple ]; then
      PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --isolated --only-binary=:all: \
        --index-url file:///opt/pypi/simple --target /tmp/site-mpl matplotlib >> "$LOG" 2>&1 \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site-mpl
    fi
  else
    echo "zarr/dask/jaxmarl are missing and there is no .whl/ or .whl-tpu/ folder to install them from" | tee -a "$LOG" >&2
    exit 2
  fi
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

TPU=$("$PY" -c "from pipelines.cluster import tpu_count; print(tpu_count() or '')" 2>/dev/null)
{
  echo '```'
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  else
    echo "no nvidia-smi"
  fi
  echo "cpus $(nproc), $(free -g | awk '/Mem:/ {print $2 " GiB memory"}')"
  "$PY" - <<'EOF' 2>&1 | grep -v -i "submodule"
import sys, jax, zarr, numcodecs, dask, distributed
from pipelines.cluster import can_listen, gpu_count, tpu_count
print("python", sys.version.split()[0], "jax", jax.__version__, "devices", jax.devices(),
      "zarr", zarr.__version__, "numcodecs", numcodecs.__version__, "dask", dask.__version__,
      "gpu_count", gpu_count(), "tpu_count", tpu_count(), "tcp listen", can_listen())
EOF
  echo "filesystem of $DIR: $(df -hT "$DIR" | tail -1)"
  echo "disk ($DIR): $(dd if=/dev/zero of="$DIR/gpu-check-dd" bs=1M count=$DD_MB conv=fdatasync 2>&1 | tail -1)"
  rm -f "$DIR/gpu-check-dd"
  echo '```'
} >> "$TABLES" 2>&1

# ---------------------------------------------------------------- the parts
# the parts in the order GPU_CHECK_PARTS names them
for what in $PARTS; do
  case "$what" in
    write)  # the write path only: the region is made on the CPU (a TPU compiles SMAX for minutes)
      part write_throughput 150 env JAX_PLATFORMS=cpu "$PY" bench/write_throughput.py "${WRITE[@]}" --dir "$DIR" --out "$OUT"
      for f in "$RESULTS"/write_throughput*.md; do
        [ -f "$f" ] && { echo; echo "### $(basename "$f" .md)"; echo; cat "$f"; } >> "$TABLES"
      done ;;
    collect)
      for spec in "${COLLECT[@]}"; do
        read -r n t r <<< "$spec"
        [[ -z "$COLLECT_N" || " $COLLECT_N " == *" $n "* ]] || continue
        part "collect_throughput N=$n" 120 "$PY" bench/collect_throughput.py --envs "$n" --steps "$t" --repeats "$r" --out "$OUT"
        [ -f "$RESULTS/collect_throughput.md" ] && { echo; echo "### collect_throughput N=$n"; echo; cat "$RESULTS/collect_throughput.md"; } >> "$TABLES"
        rm -f "$RESULTS/collect_throughput.md"
      done ;;
    loop:*)
      algo=${what#loop:}
      part "loop $algo" "${GPU_CHECK_LOOP_LIMIT_S:-200}" "$PY" bench/gpu_check.py loop --out "$OUT" --algo "$algo" \
        --env-steps "${GPU_CHECK_ENV_STEPS:-${LOOP_STEPS[$algo]}}" --lags $LAGS --overrides $LOOP_OVERRIDES
      for profile in "$OUT"/profile-loop-"$algo"-K*.txt; do  # GPU_CHECK_PROFILE=1: each stages run sampled
        [ -f "$profile" ] || continue
        { echo; echo "### where each thread's time went: $(basename "$profile" .txt)"; echo;
          "$PY" bench/profile_summary.py "$profile"; echo; echo "inside the store's write_region:"; echo;
          "$PY" bench/profile_summary.py "$profile" --stacks-with write_region --frames 10; } >> "$TABLES" 2>> "$LOG"
      done ;;
    compile)  # where a device's first minutes go: trace, compile, first and steady call per env family
      part compile_probe 240 "$PY" bench/compile_probe.py $PROBE_ARGS
      [ -f "$RESULTS/compile_probe.md" ] && { echo; echo "### compile_probe"; echo; cat "$RESULTS/compile_probe.md"; } >> "$TABLES" ;;
    hostcopy)  # how fast a region leaves the device: as is, async, raveled per step, env axis last
      part host_copy 300 "$PY" bench/host_copy.py $HOSTCOPY_ARGS
      [ -f "$RESULTS/host_copy.md" ] && { echo; echo "### host_copy"; echo; cat "$RESULTS/host_copy.md"; } >> "$TABLES" ;;
    maps)  # SMAX learning runs (bench/smax_maps.py, the loop without Prefect, which this machine lacks):
      # GPU_CHECK_MAPS_ARGS on the accelerator and, at the same time, each ';'-separated argument
      # set of GPU_CHECK_MAPS_CPU_ARGS as a CPU-only run of its own on the machine's other cores
      MAPS_ROOT=$DIR/maps-runs
      cpu_pids=()
      IFS=';' read -ra CPU_RUNS <<< "${GPU_CHECK_MAPS_CPU_ARGS:-}"
      i=0
      for args in "${CPU_RUNS[@]}"; do
        [ -n "${args// }" ] || continue
        i=$((i + 1))
        ( eval "set -- $args"
          timeout --kill-after=10 "$(left)" env JAX_PLATFORMS=cpu "$PY" bench/smax_maps.py --orchestrator none \
            --run-root "$MAPS_ROOT/cpu$i" --results-name "maps-cpu$i" "$@" > "$OUT/maps-cpu$i.log" 2>&1
          echo "| smax_maps cpu$i ($args) | exit $? |" >> "$OUT/status.md.tmp" ) &
        cpu_pids+=($!)
      done
      # the accelerator's argument sets (';'-separated) run one after the other, each in its own
      # run root (device, device2, ...) under the one limit, which each later set shares with
      # what the ones before it left
      IFS=';' read -ra DEVICE_RUNS <<< "${GPU_CHECK_MAPS_ARGS:-}"
      maps_end=$(( $(date +%s) + ${GPU_CHECK_MAPS_LIMIT_S:-540} ))
      j=0
      for args in "${DEVICE_RUNS[@]}"; do
        [ -n "${args// }" ] || continue
        j=$((j + 1)); name=device; [ $j -gt 1 ] && name=device$j
        eval "set -- $args"
        part "smax_maps $name ($args)" "$(( maps_end - $(date +%s) ))" "$PY" bench/smax_maps.py \
          --orchestrator none --run-root "$MAPS_ROOT/$name" --results-name "maps-$name" "$@"
      done
      [ ${#cpu_pids[@]} -gt 0 ] && wait "${cpu_pids[@]}"
      # each run's curve and wall log come back (not its replay or checkpoints) in one archive:
      # the device tool brings back a few files, one folder deep
      [ -d "$MAPS_ROOT" ] && (cd "$MAPS_ROOT" && find . \( -name metrics.csv -o -name bench_wall.json \) -print0 \
        | tar czf "$OUT/maps-runs.tgz" --null -T -)
      for f in "$RESULTS"/maps-*.md; do
        [ -f "$f" ] && { echo; echo "### $(basename "$f" .md)"; echo; cat "$f"; } >> "$TABLES"
      done ;;
    learners)
      part learners "${GPU_CHECK_LEARNERS_LIMIT_S:-90}" "$PY" bench/gpu_check.py learners --out "$OUT" --seconds "$LEARN_S" --presets $PRESETS ;;
    *) echo "unknown part '$what' in GPU_CHECK_PARTS (write, collect, loop:<algo>, learners, compile, hostcopy, maps)" >&2; exit 2 ;;
  esac
done

{
  echo; echo "### parts"; echo; echo "| part | status |"; echo "|---|---|"; cat "$OUT/status.md.tmp"
  echo; echo "total $(( $(date +%s) - BEGAN )) s"
} >> "$TABLES"
rm -f "$OUT/status.md.tmp"
echo "wrote $OUT: $(ls "$OUT" | tr '\n' ' ')"
