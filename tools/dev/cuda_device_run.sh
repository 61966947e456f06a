#!/usr/bin/env bash
# Runs on the lent H200 from the repository root, with build-cuda/dist carried (tools/dev/cuda_dist.sh).
#   tools/dev/cuda_device_run.sh STAGE...   stages: info tests embed memcheck racecheck bench1 sdpa1 bench sdpa ncu
#                                          ncudur ncuscore ncusrc ab patterns sass
# (env: AB, AB_BATCHES, AB_KV2 for ab; NCU_BATCHES for ncu; KERNEL, SKIP for ncusrc; RACECHECK_FILTER, RACECHECK_TIMEOUT)
# Logs and CSVs go to $OUT. Each stage has its own time limit, so that a hung stage cannot take the whole call
# (the limits add up to more than a call's 600 s; the stages themselves take ~3 min together).
set -u
OUT=${OUT:-/tmp/locks-out}
mkdir -p "$OUT"
DIST=build-cuda/dist
export LD_LIBRARY_PATH="$PWD/$DIST/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
# The tests find the reference model through the source path compiled in (/work/main).
if [ ! -e /work/main/models ]; then mkdir -p /work && ln -sfn "$PWD" /work/main; fi
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
for stage in "$@"; do
  case "$stage" in
    info)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
        --format=csv | tee "$OUT/gpu.txt"
      nproc; (python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' || true) ;;
    tests)
      stamp tests
      timeout 180 "$DIST/bin/locks_tests" --gtest_filter='Cuda*' > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
      grep -E "^\[  (PASSED|FAILED|SKIPPED)|^\[ (summary|score|select|attention|step|real)|Failure|error" \
        "$OUT/tests.log" | head -80 ;;
    embed)  # examples/embed (built by tools/dev/cuda_dist.sh): the CPU step and the same step on the GPU
      stamp embed
      timeout 60 "$DIST/bin/embed_locks"; echo "embed rc=$?" ;;
    memcheck)
      stamp memcheck
      timeout 100 "$SAN" --tool memcheck --error-exitcode 9 "$DIST/bin/locks_tests" --gtest_filter='Cuda*' \
        > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -4 "$OUT/memcheck.log" ;;
    racecheck)
      stamp racecheck
      timeout ${RACECHECK_TIMEOUT:-240} "$SAN" --tool racecheck --error-exitcode 9 "$DIST/bin/locks_tests" \
        --gtest_filter="${RACECHECK_FILTER:-Cuda*:-CudaDecodeStep.LocksStepMatchesCpuOnRealModelKeys}" \
        > "$OUT/racecheck.log" 2>&1
      echo "racecheck rc=$?"; tail -4 "$OUT/racecheck.log" ;;
    bench1)
      stamp bench1
      timeout 120 "$DIST/bin/locks" bench --device cuda --batches 1 --runs 15 --csv "$OUT/ours_b1.csv" \
        > "$OUT/bench_b1.log" 2>&1; echo "bench rc=$?"; cat "$OUT/bench_b1.log" ;;
    sdpa1)
      stamp sdpa1
      timeout 100 python3 scripts/bench_sdpa.py --batches 1 --runs 15 --csv "$OUT/sdpa_b1.csv" \
        --ours "$OUT/ours_b1.csv" > "$OUT/sdpa_b1.log" 2>&1; echo "sdpa rc=$?"; cat "$OUT/sdpa_b1.log" ;;
    bench)
      stamp bench
      timeout 300 "$DIST/bin/locks" bench --device cuda --runs 30 --csv "$OUT/ours.csv" > "$OUT/bench.log" 2>&1
      echo "bench rc=$?"; cat "$OUT/bench.log" ;;
    sdpa)
      stamp sdpa
      timeout 240 python3 scripts/bench_sdpa.py --runs 30 --csv "$OUT/sdpa.csv" --ours "$OUT/ours.csv" \
        > "$OUT/sdpa.log" 2>&1; echo "sdpa rc=$?"; cat "$OUT/sdpa.log" ;;
    ncu)
      stamp ncu
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout 150 "$NCU" --clock-control none -k regex:'score_kernel|attention_kernel|select_kernel|share_hist' \
        -c 6 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        "$DIST/bin/locks" bench --device cuda --contexts 1048576 --kv-heads 4 --group 8 --head-dim 128 \
        --batches ${NCU_BATCHES:-1} --runs 1 > "$OUT/ncu.log" 2>&1; echo "ncu rc=$?"
      grep -E "^  [a-z_:<>0-9, ]*(score|attention|select|share)|DRAM Throughput|Memory Throughput|Duration|Compute \(SM\) Th|Issue Slots|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Grid Size" \
        "$OUT/ncu.log" | head -70 ;;
    ncudur)  # kernel durations (ncu: launch to end on the GPU, no graph-launch time) of the score pass
             # (1M tokens, 4 KV heads, NCU_BATCHES; Llama 256K) and of the 4 GiB read-ceiling kernel
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      M=gpu__time_duration.sum,dram__bytes_read.sum
      dur() {  # label, kernel regex, launches, bench arguments...
        local label=$1 k=$2 c=$3; shift 3
        timeout 150 "$NCU" --clock-control none --metrics $M -k regex:"$k" -c "$c" "$DIST/bin/locks" bench \
          --device cuda --head-dim 128 --runs 1 "$@" > "$OUT/ncudur_$label.log" 2>&1
        echo "$label: $(grep -E 'gpu__time_duration|dram__bytes_read' "$OUT/ncudur_$label.log" | awk '{print $(NF-1), $NF}' | paste -sd' ')"
      }
      dur read read_kernel 2 --contexts 131072 --kv-heads 4 --group 8 --batches 1
      for B in ${NCU_BATCHES:-1 2 4 8}; do
        dur kv4_b$B score_kernel 4 --contexts 1048576 --kv-heads 4 --group 8 --batches $B
        dur llama_b$B score_kernel 4 --contexts 262144 --kv-heads 8 --group 4 --batches $B
      done ;;
    ncuscore)  # stall reasons and hot spots of the score kernel (1M tokens, 4 KV heads, batch 1)
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout 150 "$NCU" --clock-control none -k regex:'score_kernel' -c 1 \
        --section WarpStateStats --section SchedulerStats --section SourceCounters --section SpeedOfLight \
        --print-details all "$DIST/bin/locks" bench --device cuda --contexts 1048576 --kv-heads 4 --group 8 \
        --head-dim 128 --batches 1 --runs 1 > "$OUT/ncuscore.log" 2>&1; echo "ncu rc=$?"
      grep -E "Duration|Stall [A-Z]|Issued Warp|Eligible Warps" "$OUT/ncuscore.log" | head -30
      sed -n '/Warp Stall Sampling (All Samples)/,+3p' "$OUT/ncuscore.log" | head -5 ;;
    ncusrc)  # per-instruction stall samples of one kernel (KERNEL regex, default select) at 1M tokens, 4 KV heads
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      timeout 150 "$NCU" --clock-control none -k regex:"${KERNEL:-select_kernel}" --launch-skip "${SKIP:-1}" -c 1 \
        --section SourceCounters $("$NCU" --help | grep -q warp-sampling-interval && echo --warp-sampling-interval 0) --page source --csv --print-source sass "$DIST/bin/locks" bench \
        --device cuda --contexts 1048576 --kv-heads 4 --group 8 --head-dim 128 --batches 1 --runs 1 \
        > "$OUT/ncusrc_${KERNEL:-select_kernel}.csv" 2>&1
      echo "ncu rc=$?" ;;
    ab)  # A/B: dist/bin/locks_a (previous build) vs dist/bin/locks (AB="locks_a locks locks_c" adds
         # variants; an entry "locks:NAME=value" runs that binary with an environment variable set),
         # same shapes, alternating, one call; AB_BATCHES sets the 1M kv4 batches, AB_KV2 the kv2 ones
      for r in 1 2; do for v in ${AB:-locks_a locks}; do
        bin=${v%%:*}; envs=(); [ "$bin" != "$v" ] && envs=("${v#*:}")
        [ -x "$DIST/bin/$bin" ] || continue
        run() { env "${envs[@]}" timeout 60 "$DIST/bin/$bin" bench --device cuda --head-dim 128 --runs 15 "$@" 2>&1 \
          | grep -E "^\| custom"; }
        run --contexts 1048576 --kv-heads 4 --group 8 --batches ${AB_BATCHES:-1,8} | sed "s/^/$v kv4 /"
        run --contexts 262144 --kv-heads 8 --group 4 --batches 1 | sed "s/^/$v llama /"
        run --contexts 131072,262144,1048576 --kv-heads 2 --group 16 --batches ${AB_KV2:-1,2} | sed "s/^/$v kv2 /"
        run --contexts 131072 --kv-heads 4 --group 8 --batches 1,2 | sed "s/^/$v kv4 /"
      done; done ;;
    patterns)  # read-bandwidth ceilings of the score pass's access pattern (bench/cuda_read_patterns.cu)
      # L2 flushed by a read (as in bench), batch 1 and 8 sizes; then by a write (dirty L2), batch 1
      (timeout 60 "$DIST/bin/read_patterns" read 1 8; timeout 30 "$DIST/bin/read_patterns" write 1) 2>&1 \
        | tee "$OUT/read_patterns.log" ;;
    sass)  # SASS of the score kernel, for instruction counts
      CUOBJ=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump 2>/dev/null | head -1)
      "$CUOBJ" -sass "$DIST/bin/locks" | awk '/Function : .*score_kernel/ {on=1} /Function : / && !/score_kernel/ {on=0} on' \
        > "$OUT/score_sass.txt"; wc -l "$OUT/score_sass.txt" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
stamp done
