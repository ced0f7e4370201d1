#!/usr/bin/env bash
# A/B of the eager host path on a GPU machine: a commit's tree (.old) against the working tree (.), alternating
# installs, two turns, B=1 chains of 4 and 8 (lab/host_path.py; the same script copied into both trees), then the
# pool's, records' and folded verify's tests. Results in $OUT (ab.json: every row of every run; parts.tgz).
# Prepare, from the repository root:
#   rm -rf .old && mkdir .old && git archive <commit> | tar -x -C .old && cp lab/host_path.py .old/lab/
# then run from the repository root: bash lab/host_ab.sh (carrying .whl for optuna's wheels).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1; export PYTHONPATH=/tmp/site
for turn in 1 2; do
  for v in .old .; do
    name=new; [ "$v" = .old ] && name=old
    python3 -m pip install -q --no-deps --no-build-isolation -e $v >/dev/null 2>&1 || echo "install $v failed"
    for t in 4 8; do
      timeout 200 python3 $v/lab/host_path.py --batch 1 --tree-size $t --json $OUT/$name-t$t-$turn.json > $OUT/$name-t$t-$turn.log 2>&1 || tail -5 $OUT/$name-t$t-$turn.log
    done
  done
done
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_result_pool.py tests/test_check_records.py tests/test_folded_commit.py > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
python3 - <<'PY'
import json, glob, os, collections
rows = collections.defaultdict(dict)
for f in sorted(glob.glob(os.environ["OUT"] + "/*-t*-*.json")):
    name = os.path.basename(f)[:-5]
    for k, v in json.load(open(f))["us_per_call"].items():
        rows[k][name] = v
cols = sorted({c for r in rows.values() for c in r})
print(f"{'us/call':44s}" + "".join(f"{c:>11s}" for c in cols))
for k, r in rows.items():
    if k.startswith(("tree_verify", "tree_commit", "engine", "check", "result", "run_launch", "torch.empty", "compiled.run alone (C launcher, addresses)")):
        print(f"{k[:44]:44s}" + "".join(f"{r.get(c, float('nan')):11.1f}" for c in cols))
json.dump(rows, open(os.environ["OUT"] + "/ab.json", "w"), indent=1)
PY
mkdir -p /tmp/parts && mv $OUT/*-t*-*.json $OUT/*-t*-*.log /tmp/parts/ && tar -czf $OUT/parts.tgz -C /tmp/parts .
