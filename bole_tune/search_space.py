"""The tuner's search spaces (``profiles/search_space.yaml``) and the pruning done before compiling.

The file's top-level knobs are `tree_verify`'s (`KernelConfig`); its ``commit`` section holds those of
`tree_commit` / `tree_commit_layers` (`CommitConfig`). ``SearchSpace.load(path)`` reads the first,
``SearchSpace.load(path, kind="commit")`` the second.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

from bole_tune.config import CommitConfig, KernelConfig, node_block
from bole_tune.profiles import PROFILES_DIR, Fields, ProfileError, read_yaml
from bole_tune.shapes import torch_dtype

DEFAULT_SHARED_MEMORY = 227 * 1024  # bytes per block on sm_90 when the device does not say
KINDS = {"verify": KernelConfig, "commit": CommitConfig}
COMMIT_SECTION = "commit"


def for_device(space: "SearchSpace", facts: dict, kind: str = "gpu") -> "SearchSpace":
    """``space`` as a device with these fingerprint ``facts`` can use it: with its ``tma`` knob held at 0 on a
    device without TMA (a GPU before sm_90, or a CPU), where a ``tma=1`` launch reads by pointers and would only
    measure the ``tma=0`` one again; with its ``gluon`` knob held at 0 off an sm_90 GPU (the Gluon verify's wgmma
    and TMA are Hopper's: elsewhere a ``gluon=1`` config would time the Triton kernel again)."""
    try:
        major, _, minor = str(facts.get("compute_capability", "0")).partition(".")
        capability = (int(major), int(minor or 0))
    except ValueError:
        capability = (0, 0)
    held = {}
    if space.values.get("tma", (0,)) != (0,) and not (kind == "gpu" and capability[0] >= 9):
        held["tma"] = (0,)
    if space.values.get("gluon", (0,)) != (0,) and not (kind == "gpu" and capability == (9, 0)):
        held["gluon"] = (0,)
    if not held:
        return space
    return SearchSpace({**space.values, **held}, source=space.source, kind=space.kind)


def gluon_bucket_refusal(config: KernelConfig, key) -> str:
    """"" when a Gluon config (``gluon=1``) is one the launches of bucket ``key`` (a `ShapeKey`) run on the Gluon
    verify, else why not: a bucket the planner gives resident launches of one program per head on 64-row blocks
    (trees of 33-64 nodes) of bf16 inputs with 128-wide heads, not a folded verify's (`LaunchPolicy.gluon`), and
    the tiles a ring's rounds run well (`RING_TILES`: the bucket's config runs them too; the stages are the tuner's).
    The device is `for_device`'s."""
    from bole_tune.kernels import PLANNER
    from bole_tune.kernels.verify.gluon import HEAD_DIMS, RING_TILES, tile_refusal
    from bole_tune.kernels.verify.resident import RESIDENT_MAX_NODES

    policy = PLANNER.policy
    if getattr(key, "fold", False):
        return "the folded verify (a PendingCommit fold) runs the Triton kernels"
    if key.dtype != "bf16" or (key.heads.dk, key.heads.dv) != HEAD_DIMS:
        return f"the Gluon verify takes bf16 inputs with dk, dv = {HEAD_DIMS}"
    if key.tree_bucket > RESIDENT_MAX_NODES or node_block(key.tree_bucket) != policy.gluon_block:
        return f"the Gluon verify takes trees of {policy.gluon_block // 2 + 1}-{policy.gluon_block} nodes"
    if (policy.variant(key.batch_bucket, key.heads.hv, key.tree_bucket) != "resident"
            or policy.value_split(key.batch_bucket, key.heads.hv, key.heads.dv, config.b_v) != 1):
        return "this bucket's launches are not resident launches of one program per head"
    if (config.b_k, config.b_v) != RING_TILES:
        return (f"this bucket's config also runs a ring's rounds, whose Gluon tiles are {RING_TILES[0]}/{RING_TILES[1]} "
                f"(kernels/verify/gluon.py, RING_TILES)")
    return tile_refusal(config, "write" if getattr(key, "ring", False) else "verify")


def for_key(space: "SearchSpace", key) -> "SearchSpace":
    """``space`` as bucket ``key`` can use it: its ``gluon`` knob held at 0 where no Gluon config runs on the Gluon
    verify (`gluon_bucket_refusal`), so a study of any other bucket spends no trial on one."""
    if space.kind != "verify" or space.values.get("gluon", (0,)) == (0,):
        return space
    if any(not gluon_bucket_refusal(c, key) for c in space.configs() if c.gluon):
        return space
    return SearchSpace({**space.values, "gluon": (0,)}, source=space.source, kind=space.kind)


@dataclass(frozen=True)
class SearchSpace:
    """The candidate values of every knob of a config type (``values``, in its ``knobs()`` order):
    `KernelConfig` (``kind`` "verify") or `CommitConfig` ("commit")."""

    values: dict  # knob name -> tuple of candidate values, sorted
    source: str = ""
    kind: str = "verify"
    _configs: tuple = field(default=(), compare=False, repr=False)

    @property
    def config_type(self) -> type:
        return KINDS[self.kind]

    @classmethod
    def load(cls, path=None, kind: str = "verify") -> "SearchSpace":
        """The space of ``kind`` ("verify": the file's top-level knobs; "commit": its ``commit`` section)."""
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
        path = Path(path) if path else PROFILES_DIR / "search_space.yaml"
        f = Fields(read_yaml(path), path)
        config_type = KINDS[kind]
        knobs = config_type.knobs()
        if kind == "verify":
            f.reject_unknown(set(knobs) | {COMMIT_SECTION})
        else:
            if COMMIT_SECTION not in f.data:
                raise ProfileError(f"{path}: {COMMIT_SECTION}: missing (the tree_commit knobs: "
                                   f"{', '.join(knobs)})")
            f = f.sub(COMMIT_SECTION)
            f.reject_unknown(set(knobs))
        values = {}
        defaults = {fd.name: fd.default for fd in dataclasses.fields(config_type)}
        for name in knobs:
            if name in config_type.SWITCHES and name not in f.data:
                values[name] = (defaults[name],)  # a space written before the knob existed: it stays off
                continue
            items = f.get(name, list)
            if not items:
                raise ProfileError(f"{f._where(name)}: the list is empty")
            least = 0 if name in config_type.SWITCHES else 1
            for item in items:
                if isinstance(item, bool) or not isinstance(item, int) or item < least:
                    raise ProfileError(f"{f._where(name)}: expected {'ints >= 0' if least == 0 else 'positive ints'}, "
                                       f"got {item!r}")
            values[name] = tuple(sorted(set(items)))
        try:
            configs = _combinations(config_type, values)
        except ValueError as error:
            raise ProfileError(f"{path}: {(COMMIT_SECTION + '.') if kind == 'commit' else ''}{error}") from None
        if not configs:
            raise ProfileError(f"{path}: {COMMIT_SECTION}: no valid config (b_v must be at most v_span)")
        return cls(values, source=str(path), kind=kind, _configs=tuple(configs))

    def configs(self) -> list:
        """Every valid combination of the knobs' values (a commit's ``b_v`` above its ``v_span`` is none)."""
        if not self._configs:
            object.__setattr__(self, "_configs", tuple(_combinations(self.config_type, self.values)))
        return list(self._configs)

    @property
    def size(self) -> int:
        """How many configs the space holds (every valid combination of the knobs' values)."""
        return len(self.configs())

    @property
    def grid_size(self) -> int:
        """Every combination of the knobs' values, valid or not: the points a grid sampler visits."""
        return math.prod(len(values) for values in self.values.values())

    def check_trials(self, n_trials: int) -> int:
        """``n_trials`` if a study of this space can use that many: each config is measured once at most
        (a repeat is answered from the first measurement), so more trials than configs only spin."""
        if n_trials > self.size:
            raise ValueError(f"--trials: {n_trials} is more than the {self.size} configs of the "
                             f"{'commit ' if self.kind == 'commit' else ''}search space "
                             f"({self.source or 'search_space.yaml'}); a bucket measures each config once at most")
        return n_trials

    def contains(self, config) -> bool:
        """Whether ``config`` is one of `configs` (its knobs' values in the space, and a valid combination)."""
        return (isinstance(config, self.config_type)
                and all(getattr(config, name) in values for name, values in self.values.items())
                and (not getattr(config, "gluon", 0) or not _gluon_tiles_refusal(config)))


def _combinations(config_type: type, values: dict) -> list:
    """Every combination of ``values`` that makes a config; a value no combination can use (not a power of two,
    say) raises the config's ValueError. A commit's ``b_v`` above ``v_span`` only drops that combination, and so
    does a Gluon config (``gluon=1``) with tiles the Gluon verify does not take."""
    names = list(values)
    configs = []
    for combo in itertools.product(*values.values()):
        data = dict(zip(names, combo))
        if config_type is CommitConfig and data["b_v"] > data["v_span"]:
            continue
        config = config_type(**data)
        if getattr(config, "gluon", 0) and _gluon_tiles_refusal(config):  # tiles no Gluon launch takes
            continue
        configs.append(config)
    return configs


def _gluon_tiles_refusal(config: KernelConfig) -> str:
    from bole_tune.kernels.verify.gluon import tile_refusal

    return tile_refusal(config, "verify")


def shared_memory_estimate(config: KernelConfig, tree_size: int, dtype: str) -> int:
    """Bytes of shared memory a tree_verify program needs, by the operands Triton stages there.

    The dk loop's q, k and state chunks are buffered ``num_stages`` deep; the dot products stage one
    ``[B_T, max(B_T, b_v)]`` fp32 operand pair for layout changes.
    """
    b_t = node_block(tree_size)
    per_stage = 2 * b_t * config.b_k * torch_dtype(dtype).itemsize + config.b_v * config.b_k * 4
    staging = 2 * b_t * max(b_t, config.b_v) * 4
    return config.num_stages * per_stage + staging


def commit_shared_memory_estimate(config: CommitConfig) -> int:
    """Bytes of shared memory a tree_commit program needs: ``num_stages`` state tiles ``[b_v, b_k]`` (fp32) in
    flight, and the path's ``[16, b_v]`` and ``[16, b_k]`` fp32 dot operands."""
    return config.num_stages * config.b_v * config.b_k * 4 + 16 * (config.b_v + config.b_k) * 4


def feasible(config, dk: int, dv: int, tree_size: int, dtype: str,
             shared_memory_limit: int | None = None, bucket=None) -> tuple[bool, str]:
    """Whether ``config`` (a `KernelConfig` or a `CommitConfig`) can run on this shape and device; the reason
    when it cannot. A Gluon config (``gluon=1``) needs its ``bucket`` (the `ShapeKey`) to take it
    (`gluon_bucket_refusal`); its shared memory is the compiler's to check."""
    if getattr(config, "gluon", 0):
        why = gluon_bucket_refusal(config, bucket) if bucket is not None else "a Gluon config is feasible per bucket"
        return (False, why) if why else (True, "")
    if not config.fits(dk, dv):
        if isinstance(config, CommitConfig):
            return False, f"tiles b_k={config.b_k}, v_span={config.v_span} do not divide dk={dk}, dv={dv}"
        return False, f"tiles b_k={config.b_k}, b_v={config.b_v} do not divide dk={dk}, dv={dv}"
    if isinstance(config, CommitConfig):
        need = commit_shared_memory_estimate(config)
    else:
        need = shared_memory_estimate(config, tree_size, dtype)
    limit = shared_memory_limit or DEFAULT_SHARED_MEMORY
    if need > limit:
        return False, f"needs about {need // 1024} KiB of shared memory, the device has {limit // 1024} KiB"
    return True, ""
