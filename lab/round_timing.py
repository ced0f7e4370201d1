"""One case's input sets and the timing of a verify launch and its folded round, shared by the lab's stream
experiments (`prefetch.py`, `stream_sweep.py`): each launch is checked against the float64 reference first
(outputs, and the folded launch's committed slots), then timed in one CUDA graph over rotating input sets; the
folded round with one commit mark for every launch (no memset inside the graph)."""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from bole_tune.bench import BenchCase, CaseBench
from bole_tune.kernels import PendingCommit, PendingPaths, tree_verify
from bole_tune.kernels.verify import run as run_module
from bole_tune.shapes import HeadShape
from bole_tune.timing import time_launches

HEADS_9B = HeadShape(hk=16, hv=32, dk=128, dv=128)


class RoundSets:
    """The rotating sets of one (batch, tree size, kind) case, a previous round to fold, and the pool as it was."""

    def __init__(self, heads: HeadShape, batch: int, size: int, kind: str, device):
        self.device = device
        self.bench = CaseBench(BenchCase(heads, batch, size, torch.bfloat16, 8, label="qwen3.5-9b", kind=kind), device)
        self.tree, self.pool, self.inputs, self.slots = self.bench.sets(64)
        accepted = self.bench.deepest(self.tree)
        self.tuned, self.tuned_fold = self.bench.launch(), self.bench.launch(fold=True)
        tree, pool, slots = self.tree, self.pool, self.slots
        prev = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=self.tuned)
                for i, x in enumerate(self.inputs)]
        self.outs = [tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=self.tuned)
                     for i, x in enumerate(self.inputs)]
        self.pending = [PendingCommit(PendingPaths.between_rounds(tree, accepted, slots[i], slots[i], pool.shape[0]),
                                      prev[i]) for i in range(len(self.inputs))]
        self.before = pool.clone()

    def measure(self, launch, repeats: int, timed: bool = True) -> dict:
        """Errors of ``launch`` (verify, folded outputs, folded state), then its verify and folded p50 (us)."""
        entry = {}
        try:
            entry["error"] = self.bench.error(tree_verify, launch)
            entry["fold_error"], entry["fold_state_error"] = self.bench.fold_errors(launch)
            if timed:
                tree, pool, slots, inputs, outs = self.tree, self.pool, self.slots, self.inputs, self.outs

                def verify(i):
                    x = inputs[i]
                    tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch, out=outs[i])

                def folded(i):
                    x = inputs[i]
                    tree_verify(x.q, x.k, x.v, x.g, x.beta, pool, slots[i], tree, launch=launch, out=outs[i],
                                pending=self.pending[i])

                entry["verify"] = time_launches(verify, len(inputs), self.device, repeats=repeats).p50_us
                epoch = run_module.commit_epoch
                run_module.commit_epoch = lambda: 7  # a pending path stays pending while timed: no memset
                try:
                    entry["folded"] = time_launches(folded, len(inputs), self.device, repeats=repeats).p50_us
                finally:
                    run_module.commit_epoch = epoch
        except Exception as e:  # noqa: BLE001 - a lab sweep records what failed and goes on
            entry["status"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            self.pool.copy_(self.before)
        return entry

    def release(self) -> None:
        del self.bench, self.tree, self.pool, self.inputs, self.outs, self.pending, self.before
        if self.device == "cuda":
            torch.cuda.empty_cache()


def lab_parser(smoke: bool = True) -> argparse.ArgumentParser:
    """The options every stream experiment takes: ``--json OUT``, ``--repeats N`` and (``smoke``) ``--smoke``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=30)
    if smoke:
        parser.add_argument("--smoke", action="store_true", help="small heads on the CPU interpreter: the script runs")
    return parser


@contextlib.contextmanager
def swapped(obj, name: str, value):
    """``obj.name`` set to ``value`` inside the block (a launcher `run.py` calls, a switch), restored after."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def sweep(cases, configs, variants: dict, repeats: int, heads: HeadShape = HEADS_9B, device="cuda",
          timed: bool = True, launch_for=None) -> list:
    """Each (batch, tree size, kind) of ``cases``, each stream config of ``configs``, each variant: its errors, verify
    and folded times (`RoundSets.measure`), printed as they come. ``variants`` maps a name to a function returning
    the context it runs in (None: as shipped); ``launch_for(launch, name)`` may change a variant's launch. Returns
    the rows with each variant's best runs (`best_rows`)."""
    rows = []
    for batch, size, kind in cases:
        sets = RoundSets(heads, batch, size, kind, device)
        print(f"B={batch} T={size} {kind}: tuned {sets.tuned.variant} {sets.tuned.config}, fold "
              f"{sets.tuned_fold.variant} {sets.tuned_fold.config}", flush=True)
        row = {"batch": batch, "tree_size": size, "kind": kind, "tuned": str(sets.tuned.config),
               "tuned_fold": str(sets.tuned_fold.config), "runs": []}
        for config in configs:
            base = sets.bench.launch(config=config, variant="stream")
            for name, context in variants.items():
                launch = launch_for(base, name) if launch_for else base
                with context() if context else contextlib.nullcontext():
                    entry = {"config": str(config), "kernel": name, **sets.measure(launch, repeats, timed)}
                print("   ", show(entry), flush=True)
                row["runs"].append(entry)
        rows.append(row)
        sets.release()
    return best_rows(rows, variants)


def write_json(rows: list, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def show(entry: dict) -> str:
    return " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items())


def best_rows(rows: list, names) -> list:
    """Per case and name, the runs with the lowest verify and folded times (keys ``best_verify NAME``,
    ``best_folded NAME``)."""
    for row in rows:
        for name in names:
            ok = [r for r in row["runs"] if r["kernel"] == name and "verify" in r]
            if ok:
                row[f"best_verify {name}"] = min(ok, key=lambda r: r["verify"])
                row[f"best_folded {name}"] = min(ok, key=lambda r: r["folded"])
    return rows


def print_best(rows: list, names) -> None:
    nan = float("nan")
    print("\n| 9B, us | best verify: " + " / ".join(names) + " | best folded: " + " / ".join(names) + " |")
    print("|---|---|---|")
    for row in rows:
        bv = [row.get(f"best_verify {name}", {}) for name in names]
        bf = [row.get(f"best_folded {name}", {}) for name in names]
        print(f"| B={row['batch']} T={row['tree_size']} {row['kind']} | "
              + " / ".join(f"{b.get('verify', nan):.1f} ({b.get('config', '')})" for b in bv) + " | "
              + " / ".join(f"{b.get('folded', nan):.1f} ({b.get('config', '')})" for b in bf) + " |")
