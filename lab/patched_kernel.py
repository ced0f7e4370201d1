"""A text-patched copy of the resident kernel, loaded as its own module, for the lab's timing-only experiments
(`fold_ablation.py`, `ring_corrections.py`). A comparison the product keeps becomes a switch of the shipped kernel
instead (lab/README.md)."""

from __future__ import annotations

import importlib.util
import pathlib

from bole_tune.kernels.verify import resident as resident_module


def patched_resident_kernel(patches, name: str, workdir: pathlib.Path):
    """``tree_verify_resident_kernel`` from ``kernels/verify/resident.py`` with each ``(old, new)`` of ``patches``
    replaced (each ``old`` must occur exactly once), written to ``workdir/resident_{name}.py`` and imported."""
    source = pathlib.Path(resident_module.__file__).read_text()
    for old, new in patches:
        assert source.count(old) == 1, f"{name}: the resident kernel's source changed, update the patch: {old[:60]!r}"
        source = source.replace(old, new)
    source = source.replace("from .blocks import", "from bole_tune.kernels.verify.blocks import")
    path = workdir / f"resident_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"resident_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tree_verify_resident_kernel
