#!/usr/bin/env bash
# Everything the GPU machine runs, in one call: install, GPU tests, benchmarks; a short table last.
# Usage (from the repository root, on the device machine): bash scripts/gpu_suite.sh [stage ...]
# Stages: tests bench explore (default: tests bench). Results and logs go to $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit,temperature.gpu --format=csv | tee "$OUT/gpu.csv"
stages=${*:-tests bench}
for stage in $stages; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    tests) python3 -m pytest tests -q -x -m "gpu or not gpu" -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15 ;;
    bench) bole-tune bench --model qwen3.5-9b --json "$OUT/bench-9b.json" 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
    bench-heads) bole-tune bench --model qwen3.5-27b --model qwen3.5-122b-a10b --batch 1,4,16 --tree-size 64,128 \
                   --no-commit --json "$OUT/bench-heads.json" 2>&1 | tee "$OUT/bench-heads.log" | tail -40 ;;
    explore) python3 scripts/explore_configs.py "$OUT/explore.json" 2>&1 | tee "$OUT/explore.log" | tail -50 ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
