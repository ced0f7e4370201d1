"""Scratch: time a grid of tile configs on 9B cases; registers and spills of each compiled variant."""
import itertools, json, sys
from bole_tune import KernelConfig
from bole_tune.bench import BenchCase, CaseBench, bench_verify
from bole_tune.profiles import GDNShape
from bole_tune.kernels.tree_verify import tree_verify_fwd_kernel

shape = GDNShape(16, 32, 128, 128)
rows = []
for batch, size in ((1, 64), (16, 64)):
    case = BenchCase(shape, batch, size)
    bench = CaseBench(case, "cuda")
    for b_k, b_v, w, st in itertools.product((32, 64), (32, 64, 128), (4, 8), (1, 2, 3)):
        config = KernelConfig(b_k, b_v, w, st)
        try:
            r = bench_verify("bole", case, "cuda", config=config, repeats=20, bench=bench)
        except Exception as error:
            print(batch, size, config, "FAILED", type(error).__name__, str(error)[:200]); continue
        rows.append(r)
        print(f"B={batch} T={size} {config}: {r['p50_us']:.1f} us (err {r['rel_error']:.1e})")
    best = sorted([r for r in rows if r['batch'] == batch and r['tree_size'] == size], key=lambda r: r['p50_us'])[:5]
    print("BEST", batch, size, [(r['config'], r['p50_us']) for r in best])
json.dump(rows, open(sys.argv[1], "w"), indent=1)
try:
    for device_cache in tree_verify_fwd_kernel.device_caches.values():
        for key, kernel in list(device_cache[0].items())[:80]:
            print("REGS", str(key)[-160:], getattr(kernel, "n_regs", "?"), getattr(kernel, "n_spills", "?"))
except Exception as error:
    print("no register report:", error)
