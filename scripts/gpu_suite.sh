#!/usr/bin/env bash
# What a user or maintainer runs on a GPU machine, in one call: install, then the chosen stages; a
# table of the stages last.
# Usage (from the repository root, on the GPU machine): bash scripts/gpu_suite.sh [stage ...]
#   tests     all of tests/ on the GPU (over TEST_WORKERS processes where pytest-xdist is installed: on the
#             H200 machine's 16 cores the whole suite takes about 3.5 minutes with 14, more than 9 without)
#   gputests  the kernels' tests on the GPU (production shapes, both kernels, the Gluon verify, the planner, the
#             layer, validate; over GPUTESTS_WORKERS processes, one a file, where pytest-xdist is installed: about
#             8 minutes without, the Gluon file's compile checks alone 1-2)
#   validate  bole-tune validate --production (greedy output against transformers)
#   profile   a quick profile into $OUT's database (bole-tune profile --quick, curves)
#   bench     bole-tune bench --model qwen3.5-9b (JSON in $OUT/bench-9b.json)
#   grid      bole-tune bench over the grid the round must beat the serial path on (9B; B 1-32, chains of 2-8 nodes
#             and random trees of 8-256; GRID_BATCHES and GRID_KINDS, chains
#             and/or trees, to choose), one run per batch and kind, merged into
#             $OUT/grid.json with the cheapest round against the serial round over every case
#             (bole_tune.bench.round_verdict), which it prints last
#   step      bole-tune step, every model, into a copy of the shipped database in $OUT (STEP_ARGS for more flags)
#   lookup    the runtime lookup's cost (bole-tune bench --lookup)
#   commit    tune the commit launches (bole-tune tune --commit --quick) into $OUT's database, for each model of
#             COMMIT_MODELS (default qwen3.5-9b; the shipped database has entries for qwen3.5-27b and
#             qwen3.5-122b-a10b too: about 130-170 s a model), each under COMMIT_TIMEOUT
#   rounds    tune the folded verify's and a ring write round's configs (bole-tune tune --fold, then --ring) for the
#             9B at ROUNDS_BATCHES (default 16,32) x ROUNDS_TREES (default 32) into $OUT's database: buckets whose
#             rounds otherwise run the verify's tiles (at T32 those spill: BENCHMARKS.md, "Thirty-fifth session")
#   sglang    the SGLang adapter against SGLang 0.5.23's own kernel: its tests on the GPU (production shapes
#             included) and the side-by-side benchmark (JSON in $OUT/sglang-bench.json). SGLang's kernel comes
#             from $BOLE_TUNE_ENGINE_PACKAGES, default ./.sgk where present: build it with
#             python3 scripts/engine_packages.py --sglang-kernels .sgk (and carry .sgk to the machine)
# Default: gputests bench (the speed check of a kernel change). Each stage has its own time limit
# (STAGE_TIMEOUT, e.g. TESTS_TIMEOUT=300), so later stages still run. Logs and results go to $OUT
# (or ./out): install.log, gpu.csv, one STAGE.log each and run.log (the tails shown). The machine needs
# no network: a .whl/ folder of wheels (optuna and its dependencies, pytest-xdist and execnet) is installed
# when present.
# The experiments of lab/ are not run here: lab/README.md says how they ran.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COLUMNS=150
LOG="$OUT/run.log"
stages=${*:-gputests bench}
for stage in $stages; do
  case $stage in tests|gputests|validate|profile|bench|grid|step|lookup|sglang|commit|rounds) ;; *) echo "unknown stage $stage (tests gputests validate profile bench grid step lookup sglang commit rounds)"; exit 2 ;; esac
done

rows=()
row() { rows+=("$(printf '%-9s %-6s %6ss  %s' "$1" "$2" "$3" "$4")"); }

start=$SECONDS
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
row install ok $((SECONDS - start)) "$(python3 -c 'import bole_tune, triton, torch; print(f"bole-tune {bole_tune.__version__}, torch {torch.__version__}, triton {triton.__version__}")' 2>&1 | tail -1)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,temperature.gpu --format=csv | tee "$OUT/gpu.csv"

run_stage() {  # run_stage STAGE: the stage's command, its whole output in $OUT/STAGE.log
  case $1 in
    tests) timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest tests -q -p no:cacheprovider $(python3 -c 'import xdist' \
        2>/dev/null && echo "-n ${TEST_WORKERS:-14} --dist loadfile") ;;
    gputests) timeout "${GPUTESTS_TIMEOUT:-540}" python3 -m pytest tests/test_tree_verify.py tests/test_planner.py \
        tests/test_gluon_verify.py tests/test_gdn_layer.py tests/test_validate.py -q -p no:cacheprovider \
        $(python3 -c 'import xdist' 2>/dev/null && echo "-n ${GPUTESTS_WORKERS:-4} --dist loadfile") ;;
    validate) timeout "${VALIDATE_TIMEOUT:-110}" bole-tune validate --production --prompts 2 --tokens 200 ;;
    profile) BOLE_TUNE_DB="$OUT" timeout "${PROFILE_TIMEOUT:-480}" bole-tune profile --quick --repeats 20 \
        --curve-batch 1,4,16 --curve-tree-size 16,32,64,128,256 --storage "sqlite:///$OUT/studies.sqlite3" ;;
    bench) timeout "${BENCH_TIMEOUT:-300}" bole-tune bench --model qwen3.5-9b --json "$OUT/bench-9b.json" ;;
    grid) end=$((SECONDS + ${GRID_TIMEOUT:-480}))  # each run gets what is left of the stage's time
        for b in ${GRID_BATCHES:-1 2 4 8 16 32}; do
          [[ " ${GRID_KINDS:-chains trees} " == *" chains "* ]] && timeout $((end > SECONDS ? end - SECONDS : 1)) \
            bole-tune bench --model qwen3.5-9b --batch "$b" --tree-size 2,3,4,5,6,7,8 --chain \
            --repeats "${GRID_REPEATS:-20}" --json "$OUT/grid-chains-b$b.json"
          [[ " ${GRID_KINDS:-chains trees} " == *" trees "* ]] && timeout $((end > SECONDS ? end - SECONDS : 1)) \
            bole-tune bench --model qwen3.5-9b --batch "$b" --tree-size 8,16,32,64,128,256 --ring-rounds 3 \
            --repeats "${GRID_REPEATS:-20}" --json "$OUT/grid-trees-b$b.json"
        done
        python3 -m bole_tune.bench --merge "$OUT/grid.json" "$OUT"/grid-*-b*.json && rm -f "$OUT"/grid-*-b*.json ;;
    step) [ -f "$OUT/nvidia-h200.yaml" ] || cp tuning_db/nvidia-h200.yaml "$OUT/"
        BOLE_TUNE_DB="$OUT" timeout "${STEP_TIMEOUT:-540}" bole-tune step ${STEP_ARGS:-} ;;
    lookup) timeout "${LOOKUP_TIMEOUT:-120}" bole-tune bench --lookup ;;
    commit) [ -f "$OUT/nvidia-h200.yaml" ] || cp tuning_db/nvidia-h200.yaml "$OUT/"
        local failed_rc=0  # every model is tuned; the stage fails with the last failure's status
        for model in ${COMMIT_MODELS:-qwen3.5-9b}; do
          timeout "${COMMIT_TIMEOUT:-400}" bole-tune tune --commit --quick --model "$model" --db-dir "$OUT" \
            --storage "sqlite:///$OUT/commit-studies.sqlite3" || failed_rc=$?
        done
        return $failed_rc ;;
    rounds) [ -f "$OUT/nvidia-h200.yaml" ] || cp tuning_db/nvidia-h200.yaml "$OUT/"
        local failed_rc=0
        for launch in --fold --ring; do
          timeout "${ROUNDS_TIMEOUT:-200}" bole-tune tune "$launch" --model qwen3.5-9b --batch "${ROUNDS_BATCHES:-16,32}" \
            --tree-size "${ROUNDS_TREES:-32}" --trials "${ROUNDS_TRIALS:-10}" --db-dir "$OUT" \
            --storage "sqlite:///$OUT/rounds-studies.sqlite3" || failed_rc=$?
        done
        return $failed_rc ;;
    sglang) [ -d .sgk ] && export BOLE_TUNE_ENGINE_PACKAGES=${BOLE_TUNE_ENGINE_PACKAGES:-$PWD/.sgk}
        BOLE_TUNE_REQUIRE_ENGINES=1 timeout "${SGLANG_TESTS_TIMEOUT:-240}" python3 -m pytest tests/test_sglang_adapter.py \
          -q -p no:cacheprovider -rs && timeout "${SGLANG_TIMEOUT:-420}" python3 -m bole_tune.engines.sglang \
          --out "$OUT/sglang-bench.json" ;;
  esac
}

failed=0
for stage in $stages; do
  echo "=== $stage ($(date +%T))" | tee -a "$LOG"
  start=$SECONDS
  run_stage "$stage" >"$OUT/$stage.log" 2>&1
  rc=$?
  # progress bars and the CPU-fallback notices stay in the stage's log, out of the tail
  grep -v -e "━" -e "falling back" "$OUT/$stage.log" | tail -n "${TAIL_LINES:-40}" | tee -a "$LOG"
  case $rc in 0) status=ok ;; 124|137) status=timeout; failed=1 ;; *) status="rc=$rc"; failed=1 ;; esac
  row "$stage" "$status" $((SECONDS - start)) "$(grep -v -e "━" -e '^\s*$' "$OUT/$stage.log" | tail -1 | cut -c1-110)"
done

{
  echo
  echo "stage     status   time  last line (logs in $OUT)"
  printf '%s\n' "${rows[@]}"
} | tee -a "$LOG"
exit $failed
