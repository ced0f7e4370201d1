"""Who measured: the GPU (through NVML, matched to the torch device by UUID or PCI bus id), or the CPU.

The CUDA device index a process sees depends on CUDA_VISIBLE_DEVICES (indices, UUIDs or MIG
slices), while NVML numbers every GPU of the machine, so the two are matched by UUID first, then by
PCI bus id, never by index. Fields NVML cannot give (missing library, MIG slices answering "not
supported") come from torch, or are left out; none of that is an error.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class Fingerprint:
    slug: str
    kind: str  # "gpu" or "cpu"
    name: str
    facts: dict = field(default_factory=dict)
    source: str = ""  # how the facts were read

    def __post_init__(self):
        check_slug(self.slug, "device slug")

    def as_dict(self) -> dict:
        return asdict(self)


def check_slug(slug, what: str = "GPU slug") -> str:
    """``slug`` if it can name a file in the database folder (``<folder>/<slug>.yaml``) and nothing else:
    a non-empty string without a path separator that does not start with a dot (so neither ``..`` nor a
    hidden file). Else a ValueError naming ``what`` and the slug; a name is refused, never rewritten, so
    that two different names cannot end up in one file."""
    if not isinstance(slug, str) or not slug or slug.startswith(".") or any(c in slug for c in "/\\\0"):
        raise ValueError(f"{what} {slug!r}: must be a file name such as nvidia-h200 (no path separator, no "
                         "leading dot)")
    return slug


def slugify(name: str) -> str:
    """A stable file-name form of a device name: ``NVIDIA H200`` -> ``nvidia-h200``."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-device"


def _torch_facts(index: int) -> dict:
    props = torch.cuda.get_device_properties(index)
    facts = {
        "name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
    }
    for key, attr in (("uuid", "uuid"), ("l2_cache_bytes", "L2_cache_size"),
                      ("shared_memory_per_block_bytes", "shared_memory_per_block_optin"),
                      ("shared_memory_per_sm_bytes", "shared_memory_per_multiprocessor"),
                      ("registers_per_sm", "regs_per_multiprocessor")):
        value = getattr(props, attr, None)
        if value is not None:
            facts[key] = str(value) if key == "uuid" else value
    domain, bus, dev = (getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if bus is not None:
        facts["pci_bus_id"] = f"{domain or 0:08x}:{bus:02x}:{dev or 0:02x}.0"
    facts["cuda_runtime"] = torch.version.cuda
    return facts


def _normalise_uuid(uuid: str) -> str:
    uuid = uuid.lower()
    for prefix in ("gpu-", "mig-"):
        if uuid.startswith(prefix):
            uuid = uuid[len(prefix):]
    return uuid


def _normalise_bus(bus_id: str) -> str:
    bus_id = bus_id.lower()
    parts = bus_id.split(":")
    if len(parts) == 3:  # NVML uses an 8-digit domain, some tools 4 digits
        parts[0] = parts[0][-4:].rjust(4, "0")
    return ":".join(parts)


def _nvml_facts(torch_facts: dict) -> tuple[dict, str]:
    """NVML facts of the GPU that torch sees as this device; ({}, reason) when unavailable."""
    try:
        import pynvml
    except ImportError:
        return {}, "nvidia-ml-py not installed"
    try:
        pynvml.nvmlInit()
    except Exception as error:  # no driver, no permission, ...
        return {}, f"NVML unavailable ({error})"
    try:
        wanted_uuid = _normalise_uuid(torch_facts.get("uuid", ""))
        wanted_bus = _normalise_bus(torch_facts.get("pci_bus_id", ""))
        match, how = None, ""
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            if wanted_uuid and _normalise_uuid(uuid) == wanted_uuid:
                match, how = handle, "uuid"
                break
            bus = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
            if wanted_bus and _normalise_bus(bus) == wanted_bus:
                match, how = handle, "pci bus id"
        if match is None:
            return {}, "NVML found no GPU with this device's UUID or PCI bus id (a MIG slice?)"
        facts = {"nvml_match": how}
        reads = {
            "uuid": lambda h: _text(pynvml.nvmlDeviceGetUUID(h)),
            "pci_bus_id": lambda h: _text(pynvml.nvmlDeviceGetPciInfo(h).busId),
            "driver_version": lambda h: _text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_driver_version": lambda h: _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion_v2()),
            "max_sm_clock_mhz": lambda h: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
            "max_memory_clock_mhz": lambda h: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
            "sm_clock_mhz": lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            "memory_clock_mhz": lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
            "power_limit_w": lambda h: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
            "memory_bytes": lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).total,
        }
        for key, read in reads.items():
            try:
                facts[key] = read(match)
            except Exception:  # NVML_ERROR_NOT_SUPPORTED on MIG slices and some boards
                facts[key] = "not supported"
        return facts, "nvml"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{(code % 1000) // 10}"


@functools.lru_cache(maxsize=None)
def _gpu_fingerprint(index: int) -> Fingerprint:
    facts = _torch_facts(index)
    nvml, source = _nvml_facts(facts)
    for key, value in nvml.items():
        if value != "not supported" or key not in facts:
            facts[key] = value
    facts["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    try:
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(index)
        facts["max_shared_memory_per_block_bytes"] = props.get("max_shared_mem")
        facts["max_registers_per_block"] = props.get("max_num_regs")
    except Exception:
        pass
    return Fingerprint(slug=slugify(facts["name"]), kind="gpu", name=facts["name"], facts=facts,
                       source="torch + nvml" if source == "nvml" else f"torch only: {source}")


def cpu_fingerprint() -> Fingerprint:
    machine = platform.machine() or "unknown"
    name = f"CPU {machine}"
    facts = {"name": name, "processor": platform.processor() or machine, "cores": os.cpu_count(),
             "system": platform.system()}
    return Fingerprint(slug=slugify(f"cpu-{machine}"), kind="cpu", name=name, facts=facts, source="platform")


def fingerprint(device=None) -> Fingerprint:
    """The fingerprint of ``device`` (default: the current CUDA device, or the CPU without one)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_fingerprint()
    return _gpu_fingerprint(device.index if device.index is not None else torch.cuda.current_device())
