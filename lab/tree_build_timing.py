"""sglang_tree's cost per round on the GPU: the Triton builder against the torch code it replaced, warps swept."""
import random

import torch

from bole_tune.engines.sglang import sglang_tree
from bole_tune.kernels.tree_build import build_tree_tables, tree_tables_torch
from bole_tune.timing import time_launches

rng = random.Random(0)
for b, t in [(1, 4), (1, 16), (1, 64), (8, 64), (32, 64), (32, 128)]:
    tabs = [torch.tensor([[0] + [rng.randrange(i) for i in range(1, t)] for _ in range(b)], dtype=torch.int32,
                         device="cuda") for _ in range(8)]
    new = time_launches(lambda i: sglang_tree(tabs[i]), 8, "cuda")
    old = time_launches(lambda i: tree_tables_torch(tabs[i]), 8, "cuda")
    warps = {w: round(time_launches(lambda i: build_tree_tables(tabs[i], num_warps=w), 8, "cuda").p50_us, 2)
             for w in (1, 2, 4, 8)}
    print(f"B={b} T={t}: new {new.p50_us:.2f} us, old {old.p50_us:.2f} us, warps {warps} [{new.method}]", flush=True)
