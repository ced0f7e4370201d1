"""Issue 17, eleventh session: the verify and the commit under the CPU interpreter with the GPU's arithmetic emulated,
to tell a precision limit of the algorithm from a GPU-only defect.

The interpreter multiplies every `tl.dot` in fp32 (and bf16 blocks as raw integers, so the project widens the Gram
operands to fp32 there). Here its dot is replaced: 16-bit operands are widened exactly, and the operands of a "tf32"
dot are rounded to tf32 first (to nearest; ``--truncate``: toward zero, as tensor cores take raw fp32 registers); the
Gram products take the inputs' own dtype as on a GPU. Then a batch is verified and committed and compared with the
float64 recurrence.

What it showed (the depth-19 bf16 chain the H200 committed 2.09e-2 from float64, BENCHMARKS.md "Eleventh session"):
the resident launch 1.3e-4 (rounded) / 2.4e-4 (truncated), the fused one 3e-6 / 1e-5, a depth-8 tree 6e-5 / 1.7e-4:
tf32 products and bf16 Gram products do not account for the H200's figure.

    TRITON_INTERPRET=1 python3 lab/tf32_emulation.py [--variant resident|fused] [--truncate]
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

TRUNCATE = False


def tf32(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.int32).astype(np.int64)
    bits = (bits + (0 if TRUNCATE else 0x1000)) & ~0x1FFF
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.int32).view(np.float32)


def widen(handle) -> np.ndarray:
    kind = getattr(handle.dtype, "scalar", handle.dtype)
    if kind == tl.bfloat16:
        return (handle.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if kind == tl.float16:
        return handle.data.view(np.float16).astype(np.float32)
    return handle.data


def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    ad, bd = widen(a), widen(b)
    if str(input_precision).endswith("TF32") and a.data.dtype == np.float32:
        ad, bd = tf32(ad), tf32(bd)
    return interpreter.TensorHandle(np.matmul(ad, bd, dtype=np.float32) + d.data, d.dtype.scalar)


def gpu_gram_dtype(x: torch.Tensor):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]


def main() -> None:
    global TRUNCATE
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=("resident", "fused"))
    parser.add_argument("--truncate", action="store_true")
    args = parser.parse_args()
    TRUNCATE = args.truncate
    interpreter.InterpreterBuilder.create_dot = create_dot
    from bole_tune.kernels.verify import run as run_module

    run_module.gram_dtype = gpu_gram_dtype
    from bole_tune.kernels import tree_commit, tree_verify
    from bole_tune.kernels.reference import verify_reference
    from bole_tune.workloads import make_inputs, make_tree

    def error(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    for sizes, kind, accepted, seed in (([20, 9, 6], "chain", [19, -1, 3], 3), ([7, 12, 5], "random", [6, 11, -1], 4)):
        tree = make_tree(sizes, kind, seed=seed, device="cpu", **({"max_depth": 8} if kind == "random" else {}))
        acc = torch.tensor(accepted)
        x = make_inputs(tree, 1, 2, 32, 32, torch.bfloat16, "cpu", seed=9)
        res = tree_verify(*x.args(tree), validate=False, variant=args.variant)
        ref = verify_reference(*x.args(tree))
        before = x.state.clone()
        tree_commit(x.state, x.state_indices, res, acc)
        want = ref.committed(before, x.state_indices, tree, acc)
        print(f"{kind} {sizes}: o {error(res.o, ref.o):.3e}, committed pool {error(x.state, want):.3e}")


if __name__ == "__main__":
    main()
