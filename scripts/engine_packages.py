#!/usr/bin/env python3
"""Make SGLang 0.5.23's and vLLM 0.33.0's configuration code importable on a CPU machine, for the tests
that run bole-tune's exports through the engines' own parsers (tests/test_engine_exports.py).

Usage: python3 scripts/engine_packages.py [CACHE_DIR]        (default ~/.cache/bole-tune/engine-packages)
Prints CACHE_DIR on stdout; the tests read it from $BOLE_TUNE_ENGINE_PACKAGES. A rerun that finds both
folders complete does nothing (a marker file records the recipe each was built from).

The recipe, per engine, one folder CACHE_DIR/<engine>-<version>/ put on PYTHONPATH of a subprocess only
(the engines pin versions that differ from each other and from this project's: they never share an
interpreter with the test session):
- the engine's own wheel from PyPI (`pip download --no-deps`), unzipped without its compiled extensions
  (*.so: CUDA kernels and Rust helpers, none of them on the configuration path);
- `pip install --no-deps --target` of the packages the configuration modules import at module level, at
  the version the engine's metadata pins where it pins one (transformers, compressed-tensors, xgrammar,
  apache-tvm-ffi, sentencepiece, openai, fastapi range), else the version this recipe was tested with;
  torch, numpy, pydantic, PyYAML, huggingface_hub, tokenizers, safetensors, requests, packaging come from
  the environment (bole-tune's own dependencies and its test extra);
- a placeholder `torchvision` (sglang.srt.configs imports two image-preprocessing modules that import
  torchvision at module level, and so does transformers' Qwen2-VL image processor, which vLLM imports when it
  inspects the model class; PyPI's torchvision wheels link libtorch_cuda and cannot load next to the CPU torch;
  the placeholder's names are never called on the configuration path).
vLLM runs with VLLM_TARGET_DEVICE=cpu (the CPU platform: no CUDA probing).

A failure prints one line starting "engine packages:" on stderr and exits 1 (CI fails on it).

``--sglang-kernels DIR`` builds, instead, a folder DIR/sglang_kernels-<version>/site of a few hundred KiB
for a GPU machine without network whose Python cannot load SGLang's full import chain: SGLang's own
tree-verify kernel and snapshot scatter, extracted unchanged from its wheel
(``sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py``,
``sglang/kernels/ops/mamba/mamba_state_scatter_triton.py``, ``sglang/kernels/ops/memory/ptr_table.py``), and,
for the device queries those files import from ``sglang.srt.utils`` and ``sglang.kernels.jit.utils``, a
small module of bole-tune's own (`KERNEL_SHIM`) answering them from torch as SGLang does on CUDA (the SM
version, ``torch.version.cuda`` >= 12.3 for SM90, PDL from SM90). tests/test_sglang_adapter.py checks on
the CPU that the kernel run from this folder gives bit for bit the outputs of the full one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ENGINES = {
    "sglang": {
        "version": "0.5.23",
        # What `import sglang.srt.server_args` and its resolution pipeline import at module level
        # (found by importing until nothing is missing); pins are sglang 0.5.23's own.
        "packages": [
            "transformers==5.19.0", "compressed-tensors==0.18.0", "apache-tvm-ffi==0.1.11",
            "sentencepiece==0.2.1", "psutil==7.2.2", "pybase64==1.5.1", "starlette==1.10.0",
            "msgspec==0.23.0", "pyzmq==27.3.0", "aiohttp==3.14.5", "multidict==7.2.1", "yarl==1.25.1",
            "propcache==0.5.4", "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "frozenlist==1.8.0",
            "dill==0.4.1", "loguru==0.7.3", "gguf==0.19.0",
        ],
        # include/ and csrc/ of sglang.kernels.jit must exist: its path resolver checks for them on import
        "keep": lambda name: not name.endswith(".so"),
        "torchvision_placeholder": True,
    },
    "vllm": {
        "version": "0.33.0",
        # What `vllm.engine.arg_utils` (the `vllm serve` argument parser) and VllmConfig import (loguru: what
        # compressed-tensors imports when vLLM inspects the model class, absent from a bare environment); pins
        # are vllm 0.33.0's own.
        "packages": [
            "transformers==5.19.0", "compressed-tensors==0.17.0", "xgrammar==0.2.8", "fastapi==0.136.1",
            "openai==2.25.0", "llguidance==1.7.6", "openai-harmony==0.0.8", "cbor2==6.3.0",
            "cachetools==8.0.2", "uvloop==0.23.0", "prometheus-client==0.26.0", "opentelemetry-api==1.45.2",
            "partial-json-parser==0.2.1.1.post7", "einops==0.8.2", "psutil==7.2.2", "msgspec==0.23.0",
            "pyzmq==27.3.0", "starlette==1.10.0", "aiohttp==3.14.5", "multidict==7.2.1", "yarl==1.25.1",
            "propcache==0.5.4", "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "frozenlist==1.8.0",
            "sentencepiece==0.2.1", "pybase64==1.5.1", "gguf==0.19.0", "httpx==0.28.1", "distro==1.9.0",
            "apache-tvm-ffi==0.1.11", "loguru==0.7.3",
        ],
        # the configuration code is Python; vllm/third_party's CUDA headers are not needed
        "keep": lambda name: name.endswith(".py"),
        "torchvision_placeholder": True,  # transformers' Qwen2-VL image processor, met on the model's inspection
    },
}

# Written as site/torchvision/__init__.py: every torchvision.* module and name resolves to an inert
# placeholder (InterpolationMode is a real enum: transformers builds mappings from its members on import).
TORCHVISION_PLACEHOLDER = '''"""Placeholder written by bole-tune\'s scripts/engine_packages.py: SGLang\'s configuration
modules import torchvision at module level but call none of it; PyPI\'s torchvision cannot load beside the CPU torch."""
import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+placeholder"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Inert(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return _Inert(name, (), {"__module__": self.__name__})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert(name, (), {"__module__": __name__})
'''


# The files of SGLang's wheel the kernels-only folder takes, unchanged.
KERNEL_FILES = (
    "sglang/kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py",
    "sglang/kernels/ops/mamba/mamba_state_scatter_triton.py",
    "sglang/kernels/ops/memory/ptr_table.py",
)

# bole-tune's own answers to the device queries the kernel files import (written as
# sglang/srt/utils/common.py; sglang/srt/utils/__init__.py and sglang/kernels/jit/utils.py re-export it).
KERNEL_SHIM = '''"""Written by bole-tune\'s scripts/engine_packages.py --sglang-kernels: the device queries SGLang\'s
tree-verify kernel files import, answered from torch the way SGLang answers them on CUDA and ROCm."""
import torch


def is_hip():
    return torch.version.hip is not None


def is_cuda():
    return torch.cuda.is_available() and torch.version.cuda is not None


def get_device_sm():
    if not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def is_gfx95_supported():
    return bool(torch.version.hip) and "gfx95" in torch.cuda.get_device_properties(0).gcnArchName


def is_sm90_supported():
    return (is_cuda() and get_device_sm() // 10 == 9
            and tuple(map(int, torch.version.cuda.split(".")[:2])) >= (12, 3))


def get_device_core_count(device_id=0):
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device_id).multi_processor_count
    return 0


def is_arch_support_pdl():
    return is_cuda() and not is_hip() and torch.cuda.get_device_capability()[0] >= 9
'''


class InstallError(RuntimeError):
    pass


def recipe(engine: str) -> str:
    spec = ENGINES[engine]
    return f"{engine}=={spec['version']} " + " ".join(spec["packages"]) + \
        (f" +torchvision-placeholder-{hashlib.sha256(TORCHVISION_PLACEHOLDER.encode()).hexdigest()[:8]}"
         if spec["torchvision_placeholder"] else "")


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                          capture_output=True, text=True)
    if done.returncode:
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.startswith("ERROR")]
        raise InstallError(f"pip {args[0]} {' '.join(a for a in args[1:] if not a.startswith('-'))[:200]}: "
                           f"{lines[0] if lines else (done.stderr or done.stdout).strip()[-300:]}")


def _wheel(engine: str, cache: Path) -> Path:
    """``engine``'s wheel in CACHE/wheels, downloaded once."""
    version = ENGINES[engine]["version"]
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{engine}-{version}-*.whl"))
    if not found:
        # --only-binary with an explicit target picks the same wheel whatever this interpreter is
        _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), f"{engine}=={version}")
        found = sorted(wheels.glob(f"{engine}-{version}-*.whl"))
    if not found:
        raise InstallError(f"pip download {engine}=={version}: no wheel in {wheels}")
    return found[-1]


def kernels_recipe() -> str:
    return (f"sglang=={ENGINES['sglang']['version']} " + " ".join(KERNEL_FILES)
            + f" +shim-{hashlib.sha256(KERNEL_SHIM.encode()).hexdigest()[:8]}")


def build_sglang_kernels(cache: Path, wheel_cache: Path | None = None) -> Path:
    """CACHE/sglang_kernels-<version>/site: SGLang's kernel files and `KERNEL_SHIM` (module docstring)."""
    folder = cache / f"sglang_kernels-{ENGINES['sglang']['version']}"
    marker = folder / "complete"
    if marker.is_file() and marker.read_text().strip() == kernels_recipe():
        return folder / "site"
    shutil.rmtree(folder, ignore_errors=True)
    site = folder / "site"
    with zipfile.ZipFile(_wheel("sglang", wheel_cache or cache)) as wheel:
        for name in KERNEL_FILES:
            wheel.extract(name, site)
    packages = {Path(name).parent for name in KERNEL_FILES} | {Path("sglang/srt/utils"), Path("sglang/kernels/jit")}
    for package in list(packages):
        packages.update(package.parents)
    for package in sorted(packages - {Path(".")}):
        (site / package).mkdir(parents=True, exist_ok=True)
        init = site / package / "__init__.py"
        if not init.exists():
            init.write_text("")
    (site / "sglang/srt/utils/common.py").write_text(KERNEL_SHIM)
    (site / "sglang/srt/utils/__init__.py").write_text("from .common import *  # noqa: F401,F403\n")
    (site / "sglang/kernels/jit/utils.py").write_text("from sglang.srt.utils.common import is_arch_support_pdl  # noqa: F401\n")
    marker.write_text(kernels_recipe() + "\n")
    return site


def build(engine: str, cache: Path) -> Path:
    """The folder that makes ``engine``'s configuration code importable; built unless already complete."""
    spec = ENGINES[engine]
    folder = cache / f"{engine}-{spec['version']}"
    marker = folder / "complete"
    if marker.is_file() and marker.read_text().strip() == recipe(engine):
        return folder / "site"
    shutil.rmtree(folder, ignore_errors=True)
    site = folder / "site"
    with zipfile.ZipFile(_wheel(engine, cache)) as wheel:
        for name in wheel.namelist():
            if spec["keep"](name) or ".dist-info/" in name:
                wheel.extract(name, site)
    _pip("install", "--no-deps", "--no-compile", "--target", str(site), *spec["packages"])
    if spec["torchvision_placeholder"]:
        (site / "torchvision").mkdir()
        (site / "torchvision" / "__init__.py").write_text(TORCHVISION_PLACEHOLDER)
    marker.write_text(recipe(engine) + "\n")
    return site


def main(argv: list[str]) -> int:
    kernels_only = "--sglang-kernels" in argv
    argv = [a for a in argv if a != "--sglang-kernels"]
    default = Path(os.path.expanduser("~/.cache/bole-tune/engine-packages"))
    cache = Path(argv[0] if argv else default).resolve()
    start = time.perf_counter()
    try:
        if kernels_only:
            site = build_sglang_kernels(cache, wheel_cache=default)
            print(f"SGLang's kernels ready in {site} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
            print(cache)
            return 0
        for engine in ENGINES:
            build(engine, cache)
    except (InstallError, OSError, zipfile.BadZipFile) as error:
        print(f"engine packages: could not install the engines' configuration code in {cache}: {error}",
              file=sys.stderr)
        return 1
    print(f"engine packages ready in {cache} ({time.perf_counter() - start:.0f} s): "
          + "; ".join(recipe(e).split(" ")[0] for e in ENGINES), file=sys.stderr)
    print(cache)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
