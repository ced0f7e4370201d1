"""Budgets in the form SGLang and vLLM load (`exports`), and a check that runs them through the engines'
own parsers (`engine_check`, in a subprocess with the engines' packages; see scripts/engine_packages.py).
Importing this package needs neither engine."""

from bole_tune.engines.exports import (
    ExportError,
    EngineExport,
    buckets,
    engine_settings,
    export_engine_settings,
    sglang_adaptive_config,
    sglang_static_configs,
    vllm_speculative_config,
)

__all__ = ["ExportError", "EngineExport", "buckets", "engine_settings", "export_engine_settings",
           "sglang_adaptive_config", "sglang_static_configs", "vllm_speculative_config"]
