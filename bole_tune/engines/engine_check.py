"""Run exported engine files through SGLang 0.5.23's and vLLM 0.33.0's own parsers and report what each
engine makes of them.

Two halves in one file. ``check_with_engine`` (importable without either engine) starts this file as a
script in a subprocess whose PYTHONPATH is one engine's package folder from scripts/engine_packages.py:
the engines pin versions (transformers among them) that differ from each other and from this project's,
so they never share an interpreter with the caller. The script half reads the checks as JSON on stdin and
prints one result line.

What runs, per engine, with a model folder holding only ``config.json`` {architectures:
[Qwen3_5ForConditionalGeneration], model_type: qwen3_5} (transformers' Qwen3.5 defaults fill the shapes;
no weights are read):

- SGLang, ``static``: ``prepare_server_args([... "--config", FILE])`` (SGLang's own CLI path: the argparse
  it builds and its YAML merger, whose keys are flags), then ``ServerArgs.resolve_once()``, the full
  resolution and validation pipeline a launch runs, with ``--device cpu --disable-overlap-schedule`` (no
  GPU here; overlap scheduling and the Mamba extra-buffer cache are GPU-only). Reports the resolved
  algorithm, steps, topk and draft tokens.
- SGLang, ``adaptive``: the same with ``--speculative-algorithm NEXTN --speculative-adaptive
  --speculative-adaptive-config FILE``, then the runtime's ``AdaptiveSpeculativeParams`` built from the
  file: the steps it runs at each requested batch size.
- vLLM, ``speculative_config``: the ``vllm serve`` argument parser (``EngineArgs.add_cli_args``) on
  ``--speculative-config JSON --max-num-seqs N``, ``EngineArgs.create_engine_config()`` (VllmConfig with
  its SpeculativeConfig, the MTP draft config included) under VLLM_TARGET_DEVICE=cpu, then the
  scheduler's own ``build_dynamic_sd_schedule_lookup``: the K it runs at each requested batch size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULT_MARK = "bole-tune-engine-check: "
MODEL_CONFIG = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5"}


class EngineUnavailable(RuntimeError):
    """The engine's packages are missing or do not import; the message is one line."""


def engine_site(packages, engine: str) -> Path:
    """The folder scripts/engine_packages.py built for ``engine`` under ``packages``."""
    found = sorted(Path(packages).glob(f"{engine}-[0-9]*/site"))
    complete = [site for site in found if (site.parent / "complete").is_file()]
    if not complete:
        raise EngineUnavailable(f"no {engine} packages under {packages} (run: python3 scripts/engine_packages.py "
                                f"{packages})")
    return complete[-1]


def sglang_kernel_site(packages) -> Path:
    """Where SGLang's tree-verify kernel imports from under ``packages``: the kernels-only folder
    (``scripts/engine_packages.py --sglang-kernels``: SGLang's kernel files unchanged, for a GPU machine that
    cannot load SGLang's whole import chain) where there is one, else SGLang's full package folder."""
    found = sorted(p for p in Path(packages).glob("sglang_kernels-*/site") if (p.parent / "complete").is_file())
    return found[-1] if found else engine_site(packages, "sglang")


def check_with_engine(engine: str, checks: list[dict], packages, timeout: float = 600) -> list[dict]:
    """Run ``checks`` (see the module docstring) through ``engine``'s parsers; one result per check, with
    ``error`` where the engine rejected it."""
    site = engine_site(packages, engine)
    env = dict(os.environ, PYTHONPATH=str(site), VLLM_TARGET_DEVICE="cpu", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, __file__], input=json.dumps({"engine": engine, "checks": checks}),
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=tempfile.gettempdir())
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    raise EngineUnavailable(f"{engine} check exited with {done.returncode}: {tail[-1] if tail else 'no output'}")


def _sglang(checks: list[dict], model: str) -> list[dict]:
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    base = ["--model-path", model, "--device", "cpu", "--disable-overlap-schedule"]
    out = []
    for check in checks:
        try:
            if check["kind"] == "static":
                argv = base + ["--config", check["config"]]
            else:
                argv = base + ["--speculative-algorithm", "NEXTN", "--speculative-adaptive",
                               "--speculative-adaptive-config", check["config"]]
            args = prepare_server_args(argv)
            parsed = {name: getattr(args, name) for name in ("speculative_algorithm", "speculative_num_steps",
                                                              "speculative_eagle_topk",
                                                              "speculative_num_draft_tokens")}
            args.resolve_once()
            result = {"parsed": parsed, "resolved": {
                name: resolution_result(args, name)
                for name in ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                             "speculative_num_draft_tokens", "speculative_adaptive", "max_running_requests")}}
            if check["kind"] == "adaptive":
                params = AdaptiveSpeculativeParams(result["resolved"]["speculative_num_steps"], check["config"])
                result["steps"] = {str(b): params.get_steps_for_batch(b) for b in check["batches"]}
            out.append(result)
        except Exception as error:  # the engine's verdict, reported to the caller
            out.append({"error": f"{type(error).__name__}: {error}"})
    return out


def _vllm(checks: list[dict], model: str) -> list[dict]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    out = []
    for check in checks:
        try:
            args = parser.parse_args(["--model", model, "--speculative-config", check["json"],
                                      "--max-num-seqs", str(check["max_num_seqs"])])
            config = EngineArgs.from_cli_args(args).create_engine_config()
            spec = config.speculative_config
            schedule = spec.num_speculative_tokens_per_batch_size
            lookup = build_dynamic_sd_schedule_lookup(
                schedule, vllm_max_batch_size=config.scheduler_config.max_num_seqs,
                vllm_num_speculative_tokens=spec.num_speculative_tokens)
            out.append({"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                        "schedule": [list(r) for r in schedule], "max_num_seqs": config.scheduler_config.max_num_seqs,
                        "k": {str(b): lookup[b] for b in check["batches"]}})
        except Exception as error:  # the engine's verdict, reported to the caller
            out.append({"error": f"{type(error).__name__}: {error}"})
    return out


def main() -> None:
    request = json.load(sys.stdin)
    with tempfile.TemporaryDirectory(prefix="bole-tune-engine-model-") as model:
        (Path(model) / "config.json").write_text(json.dumps(MODEL_CONFIG))
        run = _sglang if request["engine"] == "sglang" else _vllm
        results = run(request["checks"], model)
    print(RESULT_MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    # run as a script, this folder comes first on sys.path, and it holds bole-tune's sglang.py, which would
    # shadow SGLang's own package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    main()
