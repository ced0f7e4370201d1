"""scripts/kernel_lab.py times the shipped kernels with textual patches (ablations, candidates): every patch
must still find its text in the kernel source, or the lab would fail on the GPU after a kernel change."""

import importlib.util
import pathlib

import pytest

LAB = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "kernel_lab.py"


def load_lab():
    spec = importlib.util.spec_from_file_location("kernel_lab", LAB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lab = load_lab()
TABLES = [("PATCHES", lab.SRC), ("RESIDENT_PATCHES", lab.RESIDENT_SRC), ("COMMIT_PATCHES", lab.COMMIT_SRC)]
CASES = [(table, name) for table, _ in TABLES for name in getattr(lab, table)]


@pytest.mark.parametrize("table,name", CASES, ids=[f"{t}-{n}" for t, n in CASES])
def test_lab_patch_applies_to_the_shipped_source(table, name):
    source = dict(TABLES)[table].read_text()
    for old, new in getattr(lab, table)[name]:
        assert old in source, f"{table}[{name!r}] no longer matches its kernel: {old.strip()[:80]!r}"
        assert old != new
