#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: install, GPU tests, tuning, profiling; tables last.
# Usage (from the repository root, on the device machine): bash scripts/gpu_suite.sh [stage ...]
# Results and logs go to $OUT (or ./out). Each stage has its own time limit so later ones still run.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=150
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,temperature.gpu --format=csv | tee "$OUT/gpu.csv"
LOG="$OUT/run.log"
stages=${*:-tests bench}
for stage in $stages; do
  echo "=== $stage ($(date +%T))" | tee -a "$LOG"
  case $stage in
    sanitize)
      timeout 40 python3 scripts/crash_case.py 128 16 8 1 4 128 2>&1 | tail -3 | tee -a "$LOG"
      timeout 60 compute-sanitizer --tool memcheck --print-limit 3 python3 scripts/crash_case.py 128 16 8 1 1 128 2>&1 \
        | grep -v "^=========     Host Frame" | head -40 | tee -a "$LOG" ;;
    tests) timeout 100 python3 -m pytest tests/test_tree_verify.py -q -p no:cacheprovider 2>&1 | tail -15 | tee -a "$LOG" ;;
    layertests) timeout 100 python3 -m pytest tests/test_gdn_layer.py tests/test_validate.py tests/test_robustness.py \
        -q -p no:cacheprovider 2>&1 | tail -12 | tee -a "$LOG" ;;
    validate) timeout 110 bole-tune validate --production --prompts 2 --tokens 200 2>&1 | grep -v "falling back" \
        | tail -12 | tee -a "$LOG" ;;
    gputests) timeout 170 python3 -m pytest tests/test_tree_verify.py -q -p no:cacheprovider -k "gpu or correlated or depth or resident or sixteen or sweeps" \
        2>&1 | tail -12 | tee -a "$LOG" ;;
    lookup) bole-tune bench --lookup 2>&1 | tee -a "$LOG" ;;
    exhaustive)
      BOLE_TUNE_DB=/tmp/exhaustive-db timeout 185 bole-tune tune --exhaustive --model qwen3.5-9b --batch 16,1 \
        --tree-size 64,16 --repeats 15 --record "$OUT/exhaustive-9b.json" 2>&1 | grep -v "━" | tail -8 | tee -a "$LOG" ;;
    profile)
      BOLE_TUNE_DB="$OUT" timeout 300 bole-tune profile --quick --repeats 20 --curve-batch 1,4,16 \
        --curve-tree-size 16,32,64,128,256 --storage "sqlite:///$OUT/studies.sqlite3" 2>&1 | grep -v "━" \
        | tail -75 | tee -a "$LOG" ;;
    step)
      cp tuning_db/nvidia-h200.yaml "$OUT/" 2>/dev/null
      BOLE_TUNE_DB="$OUT" timeout 125 bole-tune step --repeats 10 2>&1 | grep -v "━" | tail -180 | tee -a "$LOG" ;;
    bench) bole-tune bench --model qwen3.5-9b --json "$OUT/bench-9b.json" 2>&1 | tail -60 | tee -a "$LOG" ;;
    explore) python3 scripts/explore_configs.py "$OUT/explore.json" 2>&1 | tail -50 | tee -a "$LOG" ;;
    grid-*)  # the full grid of one model into $OUT's copy of the shipped database, e.g. grid-qwen3.5-9b
      [ -f "$OUT/nvidia-h200.yaml" ] || cp tuning_db/nvidia-h200.yaml "$OUT/" 2>/dev/null
      BOLE_TUNE_DB="$OUT" timeout ${GRID_TIMEOUT:-290} bole-tune profile --model "${stage#grid-}" --trials 16 --repeats 10 \
        --storage "sqlite:///$OUT/studies.sqlite3" 2>&1 | grep -v "━" | tail -60 | tee -a "$LOG" ;;
    ncu)  # the database's launch at 9B B=16 T=64 (resident) and tree_commit: sections and per-instruction stalls
      timeout ${NCU_TIMEOUT:-110} ncu --clock-control none --kernel-name regex:"tree_verify_resident_kernel|tree_commit_kernel" \
        --launch-skip 6 --launch-count 4 --import-source yes --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --section SourceCounters -f -o "$OUT/ncu" python3 scripts/kernel_lab.py --ncu >"$OUT/ncu.log" 2>&1
      tail -3 "$OUT/ncu.log" | tee -a "$LOG"
      ncu -i "$OUT/ncu.ncu-rep" --page details >"$OUT/ncu-details.txt" 2>&1
      for k in tree_verify_resident_kernel tree_commit_kernel; do
        ncu -i "$OUT/ncu.ncu-rep" --kernel-name "$k" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/ncu-$k-sass.csv.gz"
        ncu -i "$OUT/ncu.ncu-rep" --kernel-name "$k" --page source --csv --print-source cuda 2>&1 | gzip >"$OUT/ncu-$k-src.csv.gz"
      done
      rm -f "$OUT/ncu.ncu-rep"
      grep -E "^  [a-z_]+kernel|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Warp Cycles Per Issued|Local Memory Spilling Req" \
        "$OUT/ncu-details.txt" | tee -a "$LOG" ;;
    readout) timeout ${READOUT_TIMEOUT:-400} python3 scripts/kernel_lab.py --readout "$OUT/readout.json" 2>&1 | tail -120 | tee -a "$LOG" ;;
    maxnreg) timeout ${MAXNREG_TIMEOUT:-500} python3 scripts/kernel_lab.py --maxnreg "$OUT/maxnreg.json" 2>&1 | tail -150 | tee -a "$LOG" ;;
    split) timeout ${SPLIT_TIMEOUT:-330} python3 scripts/kernel_lab.py --split "$OUT/split.json" 2>&1 | tail -80 | tee -a "$LOG" ;;
    commitcand) timeout ${COMMIT_TIMEOUT:-200} python3 scripts/kernel_lab.py --commit-cand "$OUT/commit-cand.json" 2>&1 \
        | tail -80 | tee -a "$LOG" ;;
    rescand2) timeout ${RESCAND_TIMEOUT:-240} python3 scripts/kernel_lab.py --resident-cand "$OUT/resident-cand2.json" \
        "${RESCAND_NAMES:-r-base,d-qk32,c-bf16s}" 2>&1 | grep -v "^     regs" | tail -80 | tee -a "$LOG" ;;
    rescand) timeout 370 python3 scripts/kernel_lab.py --resident-cand "$OUT/resident-cand.json" 2>&1 | tail -150 | tee -a "$LOG" ;;
    tunercheck) timeout 120 python3 scripts/check_tuner_resident.py 2>&1 | grep -v Warn | tail -8 | tee -a "$LOG" ;;
    reslab) timeout 420 python3 scripts/kernel_lab.py --resident-lab "$OUT/resident-lab.json" 2>&1 | tail -150 | tee -a "$LOG" ;;
    part-*)  # a partial re-profile of one model into $OUT's database (entries and curve points, merged):
      # PART_BATCH=8,16,32 PART_TREE=64
      [ -f "$OUT/nvidia-h200.yaml" ] || cp tuning_db/nvidia-h200.yaml "$OUT/" 2>/dev/null
      BOLE_TUNE_DB="$OUT" timeout ${PART_TIMEOUT:-240} bole-tune profile --model "${stage#part-}" \
        --batch "${PART_BATCH:-8,16,32}" --tree-size "${PART_TREE:-64}" --trials 8 --repeats 10 \
        --storage "sqlite:///$OUT/part.sqlite3" 2>&1 | grep -v "━" | tail -40 | tee -a "$LOG" ;;
    retune-*)  # re-tune some buckets of one model into $OUT's database: RETUNE_BATCH=8,16 RETUNE_TREE=64
      [ -f "$OUT/nvidia-h200.yaml" ] || cp tuning_db/nvidia-h200.yaml "$OUT/" 2>/dev/null
      BOLE_TUNE_DB="$OUT" timeout ${RETUNE_TIMEOUT:-120} bole-tune tune --model "${stage#retune-}" --trials 16 \
        --repeats 10 --batch "${RETUNE_BATCH:-16}" --tree-size "${RETUNE_TREE:-64}" \
        --storage "sqlite:///$OUT/retune.sqlite3" 2>&1 | grep -v "━" | tail -20 | tee -a "$LOG" ;;
    resident) timeout 300 python3 scripts/kernel_lab.py --resident "$OUT/resident.json" 2>&1 | tail -60 | tee -a "$LOG" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
