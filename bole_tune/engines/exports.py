"""A budget entry in the form each engine loads as it is: SGLang 0.5.23's ``--config`` YAML and
``--speculative-adaptive-config`` JSON, vLLM 0.33.0's ``--speculative-config`` JSON.

Buckets (the same rule as ``bole_tune.get_budget``): the entry of measured batch B_i serves the batch sizes
B_{i-1}+1 .. B_i (B_0 = 0), and the largest measured batch B_n also serves every batch above it. Its
``serves`` field says so: ``[B_{i-1}+1, B_i]``, ``[B_{n-1}+1, None]`` for the last.

What each engine is given, per (model, workload) entry:

- ``engine: sglang`` (EAGLE beam trees): one YAML file per bucket for ``--config`` (its keys are flags:
  ``speculative-algorithm: NEXTN``, ``speculative-num-steps``, ``speculative-eagle-topk``,
  ``speculative-num-draft-tokens``). SGLang has no per-batch-size static input, so the operator picks the
  file whose batch range holds the server's ``--max-running-requests`` (SGLang sets 48 when speculation is
  on and the flag is absent). NEXTN is SGLang's name for a model's built-in MTP head; it resolves to EAGLE
  with the draft layer read from the target checkpoint (``--speculative-algorithm EAGLE`` is the same
  code path, and what SGLang's resolution reports).
  Where every bucket's choice is a chain (topk 1), also one JSON for ``--speculative-adaptive
  --speculative-adaptive-config``: keys are the buckets' lowest batch sizes as integer strings, each
  ``{"candidate_steps": [K]}`` with K the draft steps (= draft tokens of the chain). SGLang's adaptive
  mode routes a batch to the slot of the largest key not above it (after rounding the batch up to a
  captured CUDA-graph batch size), and a slot with one candidate never moves, so the server runs K of the
  bucket at every batch size. SGLang's adaptive mode supports topk 1 only: with a tree at some bucket no
  adaptive file is written (the notes say which bucket).
- ``engine: vllm`` (chains): the ``--speculative-config`` JSON ``{"method": "mtp", "num_speculative_tokens":
  max K, "num_speculative_tokens_per_batch_size": [[1, B_1, K_1], [B_1+1, B_2, K_2], ...,
  [B_{n-1}+1, VLLM_LAST_RANGE_END, K_n]]}``. ``num_speculative_tokens`` is the largest K because vLLM
  clamps every scheduled K to it; the ranges are contiguous, so vLLM's gap rule (a gap takes the previous
  range's K) never applies; vLLM reads its schedule only up to ``--max-num-seqs``, so the last range may
  end anywhere above it (VLLM_LAST_RANGE_END).
- ``engine: bole`` (free trees for bole-tune's own verifier): nothing for an engine; read with
  ``bole_tune.get_budget``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bole_tune.atomic import write_text_atomic

ENGINES = ("sglang", "vllm", "bole")
SGLANG_ALGORITHM = "NEXTN"
SGLANG_FLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
VLLM_METHOD = "mtp"
# The end of vLLM's last range: any batch size a server can be given. vLLM validates only that a range's
# end is positive and not below its start, and expands the schedule up to --max-num-seqs (128 on CPU, 256
# or 1024 on GPUs by default, no upper limit), carrying the last K past the last range's end anyway.
VLLM_LAST_RANGE_END = 1 << 20
FILE_MODE = 0o644
# Hugging Face repositories of the models bole-tune profiles; others default to Qwen/<model>
MODEL_PATHS = {"Qwen3-Next-80B-A3B": "Qwen/Qwen3-Next-80B-A3B-Instruct"}


class ExportError(ValueError):
    """A budget entry that cannot be exported; the message names the field."""


@dataclass(frozen=True)
class Bucket:
    """The batch sizes ``low`` .. ``high`` (``None``: no upper end) served by the entry of ``batch``."""

    low: int
    high: int | None
    batch: int
    settings: dict

    @property
    def label(self) -> str:
        return f"b{self.low}-{self.high if self.high is not None else 'max'}"


@dataclass
class EngineExport:
    """What one budget entry gives its engine: file name -> text, the command lines, and notes."""

    engine: str
    files: dict[str, str] = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _count(value, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ExportError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _text(entry: dict, name: str) -> str:
    value = entry.get(name)
    if not isinstance(value, str) or not value:
        raise ExportError(f"{name}: expected a non-empty string, got {value!r}")
    return value


def _batch_key(key) -> int:
    try:
        batch = int(key)
    except (TypeError, ValueError):
        raise ExportError(f"batches: key {key!r} is not a batch size") from None
    if batch < 1 or str(batch) != str(key).strip():
        raise ExportError(f"batches: key {key!r} is not a positive batch size")
    return batch


def check_engine(engine) -> str:
    if engine not in ENGINES:
        raise ExportError(f"engine: unknown {engine!r} (known: {', '.join(ENGINES)})")
    return engine


def buckets(entry: dict) -> list[Bucket]:
    """The entry's batch buckets, smallest first, each checked against the bucket rule."""
    if not isinstance(entry, dict):
        raise ExportError(f"budget entry: expected a mapping, got {type(entry).__name__}")
    batches = entry.get("batches")
    if not isinstance(batches, dict) or not batches:
        raise ExportError(f"batches: expected a non-empty mapping of batch size -> settings, got {batches!r}")
    measured = sorted((_batch_key(key), value) for key, value in batches.items())
    out = []
    for i, (batch, settings) in enumerate(measured):
        where = f"batches.{batch}"
        if not isinstance(settings, dict):
            raise ExportError(f"{where}: expected a mapping, got {settings!r}")
        if settings.get("batch", batch) != batch:
            raise ExportError(f"{where}.batch: {settings['batch']!r} under the key {batch}")
        low, high = (measured[i - 1][0] + 1 if i else 1), (batch if i < len(measured) - 1 else None)
        served = settings.get("serves")
        if served is not None and list(served) != [low, high]:
            raise ExportError(f"{where}.serves: {list(served)!r}, but the measured batches make it "
                              f"[{low}, {high}] (each serves the sizes above the previous measured one)")
        out.append(Bucket(low, high, batch, settings))
    return out


def _sglang_flags(bucket: Bucket) -> dict:
    """The bucket's (steps, topk, draft tokens), checked against what SGLang's beam search can build."""
    where = f"batches.{bucket.batch}.sglang"
    flags = bucket.settings.get("sglang")
    if not isinstance(flags, dict):
        raise ExportError(f"{where}: missing (an sglang budget entry gives {', '.join(SGLANG_FLAGS)} per batch)")
    steps, topk, draft = (_count(flags.get(name), f"{where}.{name}") for name in SGLANG_FLAGS)
    if topk == 1 and draft != steps + 1:
        raise ExportError(f"{where}.speculative_num_draft_tokens: {draft}, but with topk 1 SGLang verifies "
                          f"the chain of num_steps + 1 = {steps + 1} tokens (it overrides the flag)")
    # SGLang scores topk first-step tokens and topk^2 expansions at each later step, and keeps the best
    # num_draft_tokens - 1 of them (torch.topk over that list in organize_draft_results)
    candidates = topk + (steps - 1) * topk * topk
    if draft < 2 or draft - 1 > candidates:
        raise ExportError(f"{where}.speculative_num_draft_tokens: {draft}, but {steps} steps of top-{topk} beam "
                          f"search propose {candidates} candidates, so 2 .. {candidates + 1} tokens can be verified")
    return {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": draft}


def _vllm_k(bucket: Bucket) -> int:
    where = f"batches.{bucket.batch}"
    shape = bucket.settings.get("shape")
    if shape != "chain":
        raise ExportError(f"{where}.shape: {shape!r}, but vLLM verifies chains only (no tree option)")
    flags = bucket.settings.get("vllm")
    if not isinstance(flags, dict):
        raise ExportError(f"{where}.vllm: missing (a vllm budget entry gives num_speculative_tokens per batch)")
    return _count(flags.get("num_speculative_tokens"), f"{where}.vllm.num_speculative_tokens")


def model_path(entry: dict) -> str:
    """The Hugging Face repository an engine loads for the entry's model."""
    model = _text(entry, "model")
    return MODEL_PATHS.get(model, f"Qwen/{model}")


def _stem(entry: dict) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9._-]+", "-", _text(entry, name)) for name in ("model", "workload"))


def _where(folder, name: str) -> str:
    return shlex.quote(str(Path(folder) / name) if folder is not None else name)


def sglang_static_configs(entry: dict) -> dict[str, tuple[Bucket, dict]]:
    """File name -> (bucket, the ``--config`` YAML mapping of its flags), one per bucket."""
    out = {}
    for bucket in buckets(entry):
        flags = _sglang_flags(bucket)
        config = {"speculative-algorithm": SGLANG_ALGORITHM}
        config.update({name.replace("_", "-"): value for name, value in flags.items()})
        out[f"sglang-{_stem(entry)}-{bucket.label}.yaml"] = (bucket, config)
    return out


def sglang_adaptive_config(entry: dict) -> tuple[dict | None, str | None]:
    """The ``--speculative-adaptive-config`` mapping, or None and the reason SGLang cannot take one."""
    config = {}
    for bucket in buckets(entry):
        flags = _sglang_flags(bucket)
        if flags["speculative_eagle_topk"] != 1:
            return None, (f"no SGLang adaptive config: the choice at batch sizes {bucket.low}-"
                          f"{bucket.high if bucket.high is not None else 'max'} is a top-"
                          f"{flags['speculative_eagle_topk']} tree, and SGLang's adaptive speculation "
                          "runs topk 1 chains only (it turns itself off otherwise); use the static files")
        config[str(bucket.low)] = {"candidate_steps": [flags["speculative_num_steps"]]}
    return config, None


def vllm_speculative_config(entry: dict) -> dict:
    """The ``--speculative-config`` mapping: MTP with the per-batch-size K schedule of the buckets."""
    schedule = []
    for bucket in buckets(entry):
        k = _vllm_k(bucket)
        high = bucket.high if bucket.high is not None else max(VLLM_LAST_RANGE_END, bucket.low)
        schedule.append([bucket.low, high, k])
    return {"method": VLLM_METHOD, "num_speculative_tokens": max(k for _, _, k in schedule),
            "num_speculative_tokens_per_batch_size": schedule}


def _header(entry: dict, what: str) -> str:
    return (f"# bole-tune budget for {entry['model']} ({entry.get('dtype', 'bf16')}, tp {entry.get('tp', 1)}), "
            f"workload {entry['workload']}: {what}\n")


def engine_settings(entry: dict, folder=None) -> EngineExport:
    """The files, command lines and notes for the entry's engine (commands name files under ``folder``)."""
    if not isinstance(entry, dict):
        raise ExportError(f"budget entry: expected a mapping, got {type(entry).__name__}")
    engine = check_engine(entry.get("engine"))
    out = EngineExport(engine)
    stem, model = _stem(entry), model_path(entry)
    if engine == "sglang":
        for name, (bucket, config) in sglang_static_configs(entry).items():
            served = f"{bucket.low}-{bucket.high if bucket.high is not None else 'max'}"
            out.files[name] = _header(entry, f"batch sizes {served}, measured at {bucket.batch}; the server's "
                                             "--max-running-requests should fall in that range") + \
                yaml.safe_dump(config, sort_keys=False)
            out.commands.append(f"python -m sglang.launch_server --model-path {model} --config {_where(folder, name)} "
                                f"--max-running-requests {bucket.batch}")
        adaptive, reason = sglang_adaptive_config(entry)
        if adaptive is None:
            out.notes.append(reason)
        else:
            name = f"sglang-{stem}-adaptive.json"
            out.files[name] = "{\n" + ",\n".join(f"  {json.dumps(key)}: {json.dumps(value)}"
                                                  for key, value in adaptive.items()) + "\n}\n"
            largest = buckets(entry)[-1].batch
            out.commands.append(f"python -m sglang.launch_server --model-path {model} --speculative-algorithm "
                                f"{SGLANG_ALGORITHM} --speculative-adaptive --speculative-adaptive-config "
                                f"{_where(folder, name)} --max-running-requests {largest}")
    elif engine == "vllm":
        text = json.dumps(vllm_speculative_config(entry), separators=(",", ":"))
        name = f"vllm-{stem}.json"
        out.files[name] = text + "\n"
        out.commands.append(f"vllm serve {model} --speculative-config {shlex.quote(text)}")
    else:
        out.notes.append("engine 'bole': free trees for bole-tune's own verifier, read at run time with "
                         "bole_tune.get_budget; neither SGLang nor vLLM can build them, so no engine file")
    return out


def export_engine_settings(entry: dict, folder) -> list[Path]:
    """Write the entry's engine files into ``folder`` (atomically, mode 0644) and, beside them,
    ``<engine>-<model>-<workload>-commands.txt`` with the command lines and notes; return the paths."""
    folder = Path(folder)
    export = engine_settings(entry, folder)
    written = []
    for name, text in export.files.items():
        write_text_atomic(folder / name, text, mode=FILE_MODE)
        written.append(folder / name)
    if export.commands or export.notes:
        name = f"{export.engine}-{_stem(entry)}-commands.txt"
        text = "".join(f"# {note}\n" for note in export.notes) + "".join(f"{line}\n" for line in export.commands)
        write_text_atomic(folder / name, text, mode=FILE_MODE)
        written.append(folder / name)
    return written
