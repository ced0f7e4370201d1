"""What the tenth session's lab scripts (`order_mix.py`, `tma_state.py`, `split_stream.py`) share: one line per
measured row, the rows written as JSON, and the kernel `run.py` launches swapped for one call."""

from __future__ import annotations

import json

from bole_tune.kernels.verify import run as run_module


def show(row: dict, rows: list) -> None:
    """Print ``row`` on one line (floats to four digits) and keep it."""
    print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    rows.append(row)


def save(path: str | None, rows: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def with_resident(kernel, fn):
    """``fn()`` with ``kernel`` standing in for `run.RESIDENT` (the stream launch's kernel)."""
    shipped = run_module.RESIDENT
    run_module.RESIDENT = kernel
    try:
        return fn()
    finally:
        run_module.RESIDENT = shipped


def release(device) -> None:
    """Hand the cached blocks of the last case back (on a GPU) before the next case allocates its own."""
    if str(device) == "cuda":
        import torch

        torch.cuda.empty_cache()
