"""Issue 17, eleventh session (prepared for the next device call): how far the verify's outputs and the committed
state land from the float64 recurrence on chains deeper than the drafters' trees, by launch and input dtype.

The finding it follows: on the H200, a bf16 chain of 20 nodes (`make_tree([20, 9, 6], "chain", seed=3)`,
`make_inputs(tree, 1, 2, 32, 32, bf16, seed=9)`, accepted node 19) committed a state equal to the closed form of the
verify's factors within 1e-5 but 2.09e-2 from float64 (tests/test_path_product.py at 559f4f9), while the interpreter's
fp32 arithmetic gives 3.1e-7, and the same kernels with their tf32 products emulated on the CPU (operands rounded
or truncated to tf32) 1.3e-4 to 2.4e-4 (resident) and 3e-6 to 1e-5 (fused). So the gap is not the tf32 products;
candidates: the GPU's bf16 Gram products, the launch the GPU plans (resident, default tiles, no fp16 sweeps at depth
19), or a GPU-only path of the deep (node block 32) resident kernel.

For chains of 8-32 nodes (and the failing batch), bf16 and fp32 inputs, each launch (the planner's, "fused",
"resident"): the relative error of ``o`` and of the committed slots against `verify_reference`, and of the
committed slots against `commit_closed_form` of the kernel's own factors (the commit's arithmetic alone).

    python3 lab/deep_chain_accuracy.py [--json OUT]
    TRITON_INTERPRET=1 python3 lab/deep_chain_accuracy.py --smoke
"""

from __future__ import annotations

import argparse

import torch

from bole_tune.kernels import tree_commit, tree_verify
from bole_tune.kernels.reference import commit_closed_form, verify_reference
from bole_tune.workloads import make_inputs, make_tree
from lab_rows import save, show

CASES = [([20, 9, 6], (19, -1, 3), 3)] + [([n], (n - 1,), 3) for n in (8, 12, 16, 17, 20, 24, 32)]
VARIANTS = [None, "fused", "resident"]


def error(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    rows = []
    for sizes, accepted, seed in CASES[:2] if args.smoke else CASES:
        tree = make_tree(sizes, "chain", seed=seed, device=device)
        acc = torch.tensor(accepted, device=device)
        for dtype in (torch.bfloat16, torch.float32):
            for heads in ((1, 2, 32), (16, 32, 128)) if not args.smoke else ((1, 2, 32),):
                hk, hv, d = heads
                for variant in VARIANTS:
                    x = make_inputs(tree, hk, hv, d, d, dtype, device, seed=9)
                    row = {"sizes": sizes, "dtype": str(dtype).split(".")[-1], "heads": f"{hk}/{hv}/{d}",
                           "variant": variant or "planned"}
                    try:
                        res = tree_verify(*x.args(tree), validate=False, variant=variant)
                        ref = verify_reference(*x.args(tree))
                        closed = x.state.clone()
                        commit_closed_form(closed, x.state_indices, res, acc, validate=False)
                        before = x.state.clone()
                        res.committed.zero_()
                        tree_commit(x.state, x.state_indices, res, acc)
                        used = x.state_indices[acc >= 0].long()
                        want = ref.committed(before, x.state_indices, tree, acc)
                        row.update(o=error(res.o, ref.o), committed=error(x.state[used], want[used]),
                                   commit_vs_closed=error(x.state[used], closed[used]))
                    except Exception as e:  # noqa: BLE001 - a sweep records what failed and goes on
                        row["failed"] = f"{type(e).__name__}: {str(e)[:160]}"
                    show(row, rows)
    save(args.json, rows)


if __name__ == "__main__":
    main()
