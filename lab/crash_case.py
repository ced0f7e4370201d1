"""Run the config that raised an illegal memory access on the H200 (2026-11-29), for compute-sanitizer."""
import sys, torch
from bole_tune import KernelConfig
from bole_tune.kernels import tree_verify
from bole_tune.workloads import make_inputs, make_tree

b_k, b_v, warps, stages, batch, size = (int(x) for x in sys.argv[1:7])
tree = make_tree([size] * batch, device="cuda")
x = make_inputs(tree, 16, 32, 128, 128, torch.bfloat16, "cuda")
res = tree_verify(*x.args(tree), config=KernelConfig(b_k, b_v, warps, stages))
torch.cuda.synchronize()
print("ran", sys.argv[1:7], float(res.o.float().abs().mean()))
