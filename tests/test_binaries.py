"""The shipped database's verify and commit launches and the other kernels compiled for the H200 (sm_90) on this
machine, GPU or not (`bole_tune.binaries`): the interpreter proves what the kernels compute, this proves Triton's real
compiler takes them and that they fit an SM."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import bole_tune
from bole_tune import binaries, database


def _env(interpret: bool) -> dict:
    """This environment with or without TRITON_INTERPRET, and this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    root = str(pathlib.Path(bole_tune.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _compiled(*flags: str) -> dict:
    """`python -m bole_tune.binaries --json FLAGS`, in a process without TRITON_INTERPRET (this one runs the kernels
    under the interpreter, whose functions cannot be compiled): its rows by case."""
    tools = binaries.missing_tools()
    if tools:
        pytest.skip(f"Triton's wheel here ships no {', '.join(tools)} (in {binaries.TOOLS}): nothing to compile with")
    done = subprocess.run([sys.executable, "-m", "bole_tune.binaries", "--json", *flags], env=_env(False),
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return {row["case"]: row for row in json.loads(done.stdout)}


def _fits_an_sm(rows: dict) -> None:
    for name, row in rows.items():
        assert row["instructions"] > 0, name
        assert 0 < row["registers"] <= 255, (name, row["registers"])
        assert row["shared"] <= binaries.SM90_SHARED_BYTES, (name, row["shared"])


@pytest.fixture(scope="module")
def shipped():
    return _compiled()


def test_every_shipped_launch_compiles_and_fits_an_sm(shipped):
    assert set(shipped) == {case.name for case in binaries.SHIPPED_CASES}
    _fits_an_sm(shipped)


def test_every_entry_of_the_shipped_database_compiles_and_fits_an_sm():
    """Every verify entry (verify, folded, ring write; every model's heads), at its bucket's largest batch and tree:
    an entry tuned before a kernel change is still a launch the compiler takes."""
    rows = _compiled("--every-entry")
    entries = database.load(database.SHIPPED_DIR / "nvidia-h200.yaml")["configs"]
    assert set(rows) == set(entries)
    _fits_an_sm(rows)
    for name, row in rows.items():
        key = entries[name]["key"]
        assert row["ring"] is bool(key.get("ring")), name
        assert row["fold"] is bool(key.get("fold") or key.get("ring")), name


def test_each_case_compiled_the_launch_it_names(shipped):
    """The capture ran the round each case names: a folded verify folds, a ring round reads the ring, the others
    neither; the database's variants are the planner's (resident at one request and 64 nodes, stream at 16-32)."""
    for case in binaries.SHIPPED_CASES:
        row = shipped[case.name]
        assert row["ring"] is (case.ring is not None), case.name
        assert row["fold"] is (case.fold or case.ring is not None), case.name
    assert shipped["B1-chain4"]["variant"] == "resident"
    assert shipped["B16-tree64"]["variant"] == "resident"
    assert shipped["B16-chain4"]["variant"] == "stream"


def test_stacked_rows_take_fewer_instructions_and_registers(shipped):
    """q and k on one 16-row tile: one product per pair instead of two (docs/math.md §3, "Stacked rows")."""
    stacked, apart = shipped["B16-chain4"], shipped["B16-chain4-two-tiles"]
    assert stacked["stack_qk"] and not apart["stack_qk"] and stacked["config"] == apart["config"]
    assert stacked["instructions"] < apart["instructions"]
    assert stacked["registers"] <= apart["registers"]


def test_an_interpreted_process_is_refused_with_a_reason():
    done = subprocess.run([sys.executable, "-m", "bole_tune.binaries"], env=_env(True), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert "TRITON_INTERPRET" in done.stderr and "Traceback" not in done.stderr


def test_every_commit_launch_of_the_shipped_database_compiles_and_fits_an_sm():
    """Each distinct commit binary the shipped database can hand `tree_commit` / `tree_commit_layers` (config, heads,
    dtype, node block, one layer or more), and the commit's switches, compiled for sm_90 as the GPU builds them: the
    database's ``tma=1`` entries read by TMA, 16-bit keys' product in two tf32 pieces, the scan as wide as the node
    block up to 32 wide (`tree_commit.SCAN_WIDTH`) or, for several layers at node blocks of 64, the path from a
    table (`tree_commit.PATH_TABLE_MIN_BLOCK`), the first state tile of a ``tma=1`` launch read by pointers."""
    from bole_tune.config import node_block

    rows = _compiled("--commits")
    cases = binaries.commit_entry_cases()
    switches = binaries.commit_switch_cases()
    assert set(rows) == {c.name for c in cases} | {c.name for c in switches}
    assert len(cases) < len(database.load(database.SHIPPED_DIR / "nvidia-h200.yaml")["commit_configs"])  # shared
    _fits_an_sm(rows)
    for case in cases:
        row = rows[case.name]
        assert row["tma"] is bool(case.config.tma), case.name
        assert row["B_T"] == min(node_block(case.tree_size), 32), case.name
        assert row["first_by_pointer"] is row["tma"], case.name  # the switch as shipped, for TMA launches only
        # the path read from a table for launches of several layers at trees of more than 32 nodes, else scanned
        assert row["path_table"] is (case.layers > 1 and node_block(case.tree_size) >= 64), case.name
        assert row["product"] == "split2", case.name
    scan16, scan32, scan64 = (rows[f"B16-T64-L24-scan{w}"] for w in (16, 32, 64))
    by_tma = rows["B16-T64-L24-scan32-first-by-tma"]
    for row, width in ((scan16, 16), (scan32, 32), (scan64, 64), (by_tma, 32)):
        assert row["B_T"] == width and not row["path_table"] and row["tma"], row["case"]
        assert row["first_by_pointer"] is (row is not by_tma), row["case"]
    # the same launch as the database ships it (its binary's case: the first entry of that binary), path from the table
    shipped = rows[next(c.name for c in cases if c.config == switches[0].config and c.heads == switches[0].heads
                        and c.layers > 1 and node_block(c.tree_size) == 64)]
    assert shipped["config"] == scan16["config"] == scan64["config"] == by_tma["config"]
    assert shipped["path_table"] and shipped["first_by_pointer"]
    # a wider scan adds instructions, the table takes the scan out, the first tile's pointer loads add some
    assert shipped["instructions"] < scan16["instructions"] < scan32["instructions"] < scan64["instructions"]
    assert by_tma["instructions"] < scan32["instructions"]


def test_the_other_kernels_an_engine_launches_compile_and_fit_an_sm():
    """The serial verify, the pending paths' table, the ring's append, the tree build, the gates and the convolution
    and its commit, each captured from the call an engine makes and compiled for sm_90."""
    rows = _compiled("--others")
    assert {name: row["kernel"] for name, row in rows.items()} == {
        "serial_verify": "serial_verify_kernel", "pending_path_rows": "pending_path_rows_kernel",
        "ring_append": "ring_append_kernel", "tree_build": "tree_build_kernel", "gdn_gates": "gdn_gates_kernel",
        "tree_conv": "tree_conv_kernel", "tree_conv_commit": "tree_conv_commit_kernel"}
    _fits_an_sm(rows)



def test_what_an_untuned_gpu_runs_compiles_for_the_a100_the_l40s_the_b200_and_the_rtx_5090():
    """A GPU without a tuned database (an A100, sm_80; an L40S or RTX 4090, sm_89, whose programs get 99 KiB of
    shared memory where the H200's get 227; a B200, sm_100; an RTX 5090, sm_120) runs the planner's untuned launches,
    the commit's fallback and the other kernels: each compiles for all four and fits their programs' shared memory,
    or, for a resident launch the compiler refuses (Triton 3.6's pipeliner on sm_100), the fused launch the planner
    falls back to does (`Planner.checked`)."""
    tools = binaries.missing_tools()
    if tools:
        pytest.skip(f"Triton's wheel here ships no {', '.join(tools)} (in {binaries.TOOLS}): nothing to compile with")
    done = subprocess.run([sys.executable, "-m", "bole_tune.binaries", "--json", "--portable"], env=_env(False),
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {(row["arch"], row["case"]): row for row in json.loads(done.stdout)}
    names = ([case.name for case in binaries.PORTABLE_CASES] + [case.name for case in binaries.PORTABLE_COMMITS]
             + ["serial_verify", "pending_path_rows", "ring_append", "tree_build", "gdn_gates", "tree_conv",
                "tree_conv_commit"])
    assert set(rows) == {(arch, name) for arch in binaries.PORTABLE_ARCHES for name in names}
    assert set(binaries.PORTABLE_ARCHES) == {80, 89, 100, 120}
    verify_cases = {case.name for case in binaries.PORTABLE_CASES}
    for name, row in rows.items():
        assert row["instructions"] > 0, name
        assert 0 < row["registers"] <= 255, (name, row["registers"])
        assert row["shared"] <= row["shared_limit"] == binaries.ARCH_SHARED_BYTES[row["arch"]], (name, row["shared"])
        if row["fallback"]:  # only a verify launch falls back, and only onto the fused kernel
            assert name[1] in verify_cases and row["kernel"] == "fused", name
            assert row["fallback"].startswith(("resident did not compile", "stream did not compile")), name
    for arch in binaries.PORTABLE_ARCHES:  # the planner's untuned rule: one program per head up to 64 nodes
        assert rows[(arch, "B1-chain4")]["kernel"] == "resident"
        assert rows[(arch, "B2-tree256")]["kernel"] == "fused" and not rows[(arch, "B2-tree256")]["fallback"]
        assert rows[(arch, "commit-bf16-T64-B16-L24")]["kernel"] == "commit"
    for arch in (80, 89, 120):  # no fallback needed there
        assert not any(rows[(arch, name)]["fallback"] for name in names), arch
        assert rows[(arch, "B16-tree64")]["kernel"] == "resident"
