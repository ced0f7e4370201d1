"""Run SGLang 0.5.23's own GDN tree-verify kernel and snapshot commit on given inputs, in a subprocess.

Two halves, as in `engine_check`: ``run_sglang_cases`` (importable without SGLang) writes the cases to a file
and starts this file as a script whose PYTHONPATH is SGLang's package folder from scripts/engine_packages.py
(SGLang pins its own transformers, so it never shares the caller's interpreter); on a machine without a GPU
the script runs under ``TRITON_INTERPRET=1`` (SGLang's kernel launches there: on a CPU tensor it takes its
``(NK, NV, N * HV)`` grid). The script half calls, per case, exactly what SGLang's ``TritonGDNKernel.
target_verify`` calls: ``fused_sigmoid_gating_delta_rule_update(..., use_qk_l2norm_in_kernel=True,
softplus_beta=1.0, softplus_threshold=20.0, is_kda=False, disable_state_update=True,
intermediate_states_buffer=..., intermediate_state_indices=arange(B), cache_steps=T,
retrieve_parent_token=...)``, then the commit: on CUDA SGLang's ``fused_mamba_state_scatter_with_mask``, on a
CPU the same gather (``dst[slot_r] = snapshots[r, step_r]`` where ``step_r >= 0``, the slot is >= 0 and the
step < T) as SGLang's CPU fallback in ``HybridLinearAttnBackend._scatter_speculative_state_with_mask``.

A case is a dict of tensors: q, k ``[1, N, Hk, dk]``, v ``[1, N, Hv, dv]``, a, b ``[N, Hv]``, A_log, dt_bias
``[Hv]``, pool ``[slots, Hv, dv, dk]`` float32, cache_indices ``[B]``, parents ``[B, T]`` (SGLang's
convention), steps ``[B]``. The result per case: o ``[1, N, Hv, dv]``, snapshots ``[B, T, Hv, dv, dk]``, and
the committed pool.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULT_MARK = "bole-tune-sglang-kernel: "


def run_sglang_cases(cases: list[dict], packages=None, interpret: bool | None = None, timeout: float = 900,
                     site=None) -> list[dict]:
    """SGLang's outputs for each case (see the module docstring), its kernel imported from ``site`` (default:
    `sglang_kernel_site` of ``packages``); raises `EngineUnavailable` when SGLang's packages are missing or
    the script fails (the message is its last line of output)."""
    import torch

    from bole_tune.engines.engine_check import EngineUnavailable, sglang_kernel_site

    site = site or sglang_kernel_site(packages)
    with tempfile.TemporaryDirectory(prefix="bole-tune-sglang-kernel-") as folder:
        inputs, outputs = Path(folder) / "cases.pt", Path(folder) / "results.pt"
        torch.save([{name: x.cpu() for name, x in case.items()} for case in cases], inputs)
        env = dict(os.environ, PYTHONPATH=str(site), PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false",
                   HF_HUB_OFFLINE="1")
        if interpret is None:
            interpret = not torch.cuda.is_available()
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)
        done = subprocess.run([sys.executable, __file__, str(inputs), str(outputs)], capture_output=True, text=True,
                              env=env, timeout=timeout, cwd=folder)
        if done.returncode != 0 or not outputs.is_file():
            tail = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            raise EngineUnavailable(f"SGLang kernel run exited with {done.returncode}: "
                                    f"{tail[-1] if tail else 'no output'}")
        return torch.load(outputs)


def sglang_verify(fn, case: dict, device):
    """SGLang's target verify of one case with its snapshot buffer: (o, snapshots ``[B, T, Hv, dv, dk]``)."""
    import torch

    x = {name: t.to(device) for name, t in case.items()}
    b, t = x["parents"].shape
    hv, dv, dk = x["pool"].shape[1:]
    # SGLang allocates one spare row (`spec_state_size + 1`); requests use rows 0..B-1
    snapshots = torch.zeros(b + 1, t, hv, dv, dk, dtype=torch.float32, device=device)
    o = fn(A_log=x["A_log"], dt_bias=x["dt_bias"], q=x["q"], k=x["k"], v=x["v"], a=x["a"], b=x["b"],
           initial_state_source=x["pool"], initial_state_indices=x["cache_indices"],
           cu_seqlens=torch.arange(0, b * t + 1, t, dtype=torch.int32, device=device),
           use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
           disable_state_update=True, intermediate_states_buffer=snapshots,
           intermediate_state_indices=torch.arange(b, dtype=torch.int32, device=device), cache_steps=t,
           retrieve_parent_token=x["parents"])
    return o, snapshots, x


def main() -> None:
    import torch

    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update,
    )

    cases = torch.load(sys.argv[1])
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    results = []
    for case in cases:
        o, snapshots, x = sglang_verify(fused_sigmoid_gating_delta_rule_update, case, device)
        pool = x["pool"].clone()
        if device == "cuda":
            from sglang.kernels.ops.mamba.mamba_state_scatter_triton import fused_mamba_state_scatter_with_mask
            fused_mamba_state_scatter_with_mask(pool[None], snapshots[None], x["cache_indices"], x["steps"])
        else:
            steps, slots = x["steps"].long(), x["cache_indices"].long()
            valid = (steps >= 0) & (steps < snapshots.shape[1]) & (slots >= 0) & (slots < pool.shape[0])
            rows = valid.nonzero(as_tuple=True)[0]
            pool[slots[rows]] = snapshots[rows, steps[rows]]
        b = x["parents"].shape[0]
        results.append({"o": o.cpu(), "snapshots": snapshots[:b].cpu(), "pool": pool.cpu()})
    torch.save(results, sys.argv[2])
    print(RESULT_MARK + f"{len(results)} cases", flush=True)


if __name__ == "__main__":
    # this folder holds bole-tune's sglang.py, which would shadow SGLang's package
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    main()
