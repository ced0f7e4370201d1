"""On a GPU: the tuner's runner rejects a config the resident kernel miscompiles and times a good one.

Usage: python3 scripts/check_tuner_resident.py   (9B shapes, bucket T64-B16, the resident kernel's bucket)
"""
from bole_tune.config import KernelConfig
from bole_tune.database import ShapeKey
from bole_tune.runners import GPURunner

runner = GPURunner("cuda", repeats=5)
key = ShapeKey(32, 16, 128, 128, "bf16", 64, 16)
for config in (KernelConfig(32, 128, 8, 3), KernelConfig(32, 64, 4, 3), KernelConfig(64, 64, 4, 1)):
    m = runner.measure(key, config)
    print(f"{key.text} {config}: {m.status} p50 {m.p50_us:.1f} us rel_error {m.rel_error} {m.message}", flush=True)
