"""Replay an exhaustive H200 recording through the tuner: how close, with how many trials?

    python benchmarks/tuner_vs_exhaustive.py benchmarks/h200-2026-11-29/exhaustive-9b.json --trials 32 --seeds 30

For every bucket in the recording: the exhaustive best p50, and for each sampler seed the best the
tuner finds with at most --trials trials (default config first, TPE, then the polish phase, as in a
real run; no warm start from neighbours), the gap to the exhaustive best and the configs it measured.
"""

import argparse
import statistics

import optuna

from bole_tune.database import ShapeKey
from bole_tune.runners import ReplayRunner
from bole_tune.search_space import SearchSpace
from bole_tune.tuner import tune_bucket


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("recording")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    runner = ReplayRunner(args.recording)
    space = SearchSpace.load()
    total = len(space.configs())
    print(f"search space: {total} configs; tuner budget: {args.trials} trials ({args.trials / total:.0%})")
    for text in runner.keys():
        key = ShapeKey.from_dict(dict(zip(("hv", "hk", "dk", "dv", "dtype", "tree_bucket", "batch_bucket"),
                                          _parse(text))))
        ok = [m.p50_us for m in runner.measurements[text].values() if m.status == "ok"]
        best = min(ok)
        gaps, measured = [], []
        for seed in range(args.seeds):
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=6, multivariate=True)
            before = runner.calls
            result = tune_bucket(runner, key, space, optuna.storages.InMemoryStorage(), args.trials, "replay",
                                 sampler=sampler)
            gaps.append(result.best_measurement.p50_us / best - 1)
            measured.append(runner.calls - before)
        print(f"{text}: exhaustive best {best:.1f} us over {len(ok)} working configs; tuner gap median "
              f"{statistics.median(gaps):+.1%}, worst {max(gaps):+.1%}; within 3% in "
              f"{sum(g <= 0.03 for g in gaps)}/{len(gaps)} seeds; configs measured median {statistics.median(measured)}")


def _parse(text):
    parts = text.split("-")
    return (int(parts[0][2:]), int(parts[1][2:]), int(parts[2][2:]), int(parts[3][2:]), parts[4],
            int(parts[5][1:]), int(parts[6][1:]))


if __name__ == "__main__":
    main()
