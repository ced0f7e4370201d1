"""Replay an exhaustive H200 recording through the tuner: how close, with how many trials?

    python benchmarks/tuner_vs_exhaustive.py benchmarks/h200-2026-11-29/exhaustive-9b.json --trials 32 --seeds 30

For every bucket in the recording: the exhaustive best p50, and for each sampler seed the best the
tuner finds with at most --trials trials (default config first, TPE, then the polish phase, as in a
real run; no warm start from neighbours), the gap to the exhaustive best and the configs it measured.
The replay is `bole_tune.replay_study.replay_against_exhaustive`, which tests/test_shipped_data.py
runs on the same recording to check the README's figure.
"""

import argparse

from bole_tune.replay_study import replay_against_exhaustive
from bole_tune.search_space import SearchSpace


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("recording")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    space = SearchSpace.load()
    total = len(space.configs())
    print(f"search space: {total} configs; tuner budget: {args.trials} trials ({args.trials / total:.0%})")
    buckets = replay_against_exhaustive(args.recording, args.trials, range(args.seeds), space)
    for bucket in buckets:
        print(bucket.summary())
    runs = sum(len(b.runs) for b in buckets)
    print(f"all buckets: within 3% in {sum(b.within(0.03) for b in buckets)} of {runs} runs")


if __name__ == "__main__":
    main()
