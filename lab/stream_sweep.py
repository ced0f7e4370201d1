"""Issue 17: the stream launch's key loop with a deeper software pipeline (more stages, narrower key chunks).

`prefetch.py` showed that Triton pipelines the state-first branch's key loop (unrolled by hand it lost 25-45%):
its state tiles are requested ``num_stages - 1`` steps ahead. The tuner's search space stops at 3 stages and the
stream buckets chose 32-wide key chunks (4 steps). This sweeps 4-6 stages and 16-wide chunks (8 steps) for the
verify and the folded round of the shipped kernel, each launch checked against the float64 reference first
(`round_timing.RoundSets`).

With ``--state-split`` it times instead eight 32-wide-chunk tiles each with and without the state split (S_pre as
two bf16 parts, bf16 tensor cores; the planner takes it for trees of more than 32 nodes only).

    python3 lab/stream_sweep.py [--json OUT] [--repeats 30] [--smoke] [--state-split]
"""

from __future__ import annotations


from bole_tune.config import KernelConfig
from bole_tune.shapes import HeadShape
from round_timing import lab_parser, print_best, sweep, write_json

CASES = [(16, 4, "chain"), (32, 8, "chain"), (16, 8, "random")]
CONFIGS = ([KernelConfig(32, b_v, 2, s) for b_v in (64, 128) for s in (3, 4, 5)] + [KernelConfig(32, 64, 4, 4)]
           + [KernelConfig(16, b_v, w, s) for b_v in (64, 128) for w in (2, 4) for s in (3, 4, 6)])


def main() -> None:
    parser = lab_parser()
    parser.add_argument("--state-split", action="store_true",
                        help="each config also with S_pre taken as two bf16 parts (the planner's state_split)")
    args = parser.parse_args()
    configs = CONFIGS
    variants = {"stream": None}
    if args.state_split:
        configs = [KernelConfig(32, b_v, w, s) for b_v in (64, 128) for w in (2, 4) for s in (2, 3)]
        variants["stream + state split"] = None

    def launch_for(launch, name):
        return launch.replace(state_split=True) if name.endswith("state split") else launch

    if args.smoke:
        rows = sweep([(2, 4, "chain")], [KernelConfig(16, 32, 2, 5)], variants, 1, HeadShape(hk=2, hv=4, dk=64, dv=32),
                     "cpu", timed=False, launch_for=launch_for)
    else:
        rows = sweep(CASES, configs, variants, args.repeats, launch_for=launch_for)
    write_json(rows, args.json)
    print_best(rows, variants)
    print("\nper config (verify / folded, us):")
    for row in rows:
        print(f"B={row['batch']} T={row['tree_size']} {row['kind']}: " + "; ".join(
            f"{r['kernel']} {short(r['config'])} {r.get('verify', float('nan')):.1f}/{r.get('folded', float('nan')):.1f}"
            for r in row["runs"]))


def short(config: str) -> str:
    """``b_k=32 b_v=64 warps=2 stages=3`` as ``32/64/2/3``."""
    return "/".join(part.split("=")[1] for part in config.split())

if __name__ == "__main__":
    main()
