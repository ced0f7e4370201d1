#!/usr/bin/env bash
# A/B of the Gluon verify's launches on a GPU machine: a commit's tree (.old) against the working tree (.),
# alternating installs over TURNS turns (default 2), lab/gluon_times.py in each (the same script copied into both).
# Results in $OUT (old-N.json, new-N.json) and a table of medians last. Prepare, from the repository root:
#   rm -rf .old && mkdir .old && git archive <commit> | tar -x -C .old && cp lab/gluon_times.py .old/lab/
# then run from the repository root: bash lab/gluon_ab.sh (carrying .whl and .old).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
for turn in $(seq 1 ${TURNS:-2}); do
  for v in .old .; do
    name=new; [ "$v" = .old ] && name=old
    python3 -m pip install -q --no-deps --no-build-isolation -e $v >/dev/null 2>&1 || echo "install $v failed"
    log=$OUT/$name-$turn.log
    timeout 240 python3 $v/lab/gluon_times.py ${GLUON_TIMES_ARGS:-} --json $OUT/$name-$turn.json > $log 2>&1 \
      || tail -5 $log
  done
done
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python3 - <<'PY'
import collections, glob, json, os
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(os.environ["OUT"] + "/*-[0-9]*.json")):
    name = os.path.basename(f).split("-")[0]
    for r in json.load(open(f)):
        for k in ("verify", "ring_reads", "ring_read", "ring_write", "round_ring"):
            rows[(r["batch"], k)][name].append(r[k])
print(f"{'B, us':22s} {'old (turns)':>24s} {'new (turns)':>24s}")
for (b, k), r in rows.items():
    fmt = lambda xs: " ".join(f"{x:6.2f}" for x in xs)
    print(f"B={b:<3d}{k:17s} {fmt(r.get('old', [])):>24s} {fmt(r.get('new', [])):>24s}")
PY
