"""Scratch: time a grid of tile configs on two 9B cases (first look at the kernel's speed)."""
import itertools, json, sys, torch
from bole_tune import KernelConfig
from bole_tune.bench import BenchCase, ReferenceCheck, bench_verify
from bole_tune.profiles import GDNShape

shape = GDNShape(16, 32, 128, 128)
# copy bandwidth once
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
for _ in range(20): y.copy_(x)
e.record(); e.synchronize(); print(f"copy bandwidth {2 * 20 * x.numel() / (s.elapsed_time(e) / 1e3) / 1e12:.2f} TB/s")
del x, y
rows = []
for batch, size in ((1, 64), (16, 64), (4, 128)):
    case = BenchCase(shape, batch, size)
    check = ReferenceCheck(case, "cuda")
    for b_k, b_v, w, st in itertools.product((32, 64, 128), (16, 32, 64, 128), (4, 8), (1, 2)):
        config = KernelConfig(b_k, b_v, w, st)
        try:
            r = bench_verify("bole", case, "cuda", config=config, repeats=20, check=check)
        except Exception as error:
            print(batch, size, config, "FAILED", type(error).__name__, str(error)[:200]); continue
        rows.append(r)
        print(f"B={batch} T={size} {config}: {r['p50_us']:.1f} us (err {r['rel_error']:.1e})")
    best = sorted([r for r in rows if r['batch'] == batch and r['tree_size'] == size], key=lambda r: r['p50_us'])[:5]
    print("BEST", batch, size, [(r['config'], r['p50_us']) for r in best])
json.dump(rows, open(sys.argv[1], "w"), indent=1)
