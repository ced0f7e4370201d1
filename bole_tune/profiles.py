"""The one loader of the YAML data under ``profiles/``: model shapes and search spaces.

Every error names the file and the field, e.g. ``profiles/models/qwen3.5-9b.yaml: gdn.num_value_heads:
expected a positive int, got 'x'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from bole_tune.shapes import SUPPORTED_HEAD_DIMS, HeadShape

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
if not PROFILES_DIR.is_dir():  # installed layout: profiles/ is the data package bole_tune.profile_data
    PROFILES_DIR = Path(__file__).resolve().parent / "profile_data"


DEFAULT_MODELS = ("qwen3.5-9b", "qwen3.5-27b", "qwen3.5-122b-a10b", "qwen3-next-80b-a3b")
"""The models `profile`, `tune`, `step` and `budget` work on when none is named: every shipped profile.

`bench` alone defaults to ``qwen3.5-9b``: it is a quick check of one layer, not a database to fill."""


class ProfileError(ValueError):
    """A profile file is missing, malformed or has a bad field."""


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class FFNShape:
    kind: str  # "dense" or "moe"
    intermediate_size: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0


DRAFTER_KINDS = ("mtp",)


@dataclass(frozen=True)
class DrafterShape:
    """The drafter a model ships with. ``mtp``: multi-token prediction, ``layers`` decoder layers of the
    target's kind (full attention and its FFN) plus the shared LM head, run once per draft step."""

    kind: str = "mtp"
    layers: int = 1


@dataclass(frozen=True)
class ModelProfile:
    key: str  # file stem, e.g. "qwen3.5-9b"
    name: str
    hidden_size: int
    num_layers: int
    layers_per_attention: int
    vocab_size: int
    attention: AttentionShape
    gdn: HeadShape  # the whole model's GDN heads (before any tensor-parallel split)
    conv_width: int  # the GDN layer's short causal convolution
    ffn: FFNShape
    drafter: DrafterShape = DrafterShape()

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers // self.layers_per_attention

    @property
    def num_gdn_layers(self) -> int:
        return self.num_layers - self.num_attention_layers

    def heads(self, tp: int = 1) -> HeadShape:
        """The GDN heads one of ``tp`` tensor-parallel ranks holds (heads split evenly)."""
        try:
            return self.gdn.per_rank(tp)
        except ValueError as error:
            raise ValueError(f"{self.name}: {error}") from None


def read_text(path) -> str:
    """A text file's contents; a missing, unreadable or non-UTF-8 file (or a folder) is one `ProfileError`
    naming it."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ProfileError(f"{path}: is a folder, expected a file") from None
    except UnicodeDecodeError as error:
        raise ProfileError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    except OSError as error:
        raise ProfileError(f"{path}: cannot be read ({error.strerror or error})") from None


def read_yaml(path: Path) -> dict:
    """Parse a YAML mapping; errors name the file."""
    text = read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ProfileError(f"{path}: not valid YAML ({error})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


class Fields:
    """Typed access to a mapping; every error names the file and the dotted field."""

    def __init__(self, data: dict, path, prefix: str = ""):
        self.data, self.path, self.prefix = data, path, prefix

    def _where(self, key: str) -> str:
        return f"{self.path}: {self.prefix}{key}"

    def get(self, key: str, kind, default=...):
        if key not in self.data:
            if default is ...:
                raise ProfileError(f"{self._where(key)}: missing")
            return default
        value = self.data[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ProfileError(f"{self._where(key)}: expected a positive int, got {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ProfileError(f"{self._where(key)}: expected a number, got {value!r}")
        if kind is str and not isinstance(value, str):
            raise ProfileError(f"{self._where(key)}: expected a string, got {value!r}")
        if kind is list and not isinstance(value, list):
            raise ProfileError(f"{self._where(key)}: expected a list, got {value!r}")
        return value

    def sub(self, key: str) -> "Fields":
        value = self.get(key, dict) if key in self.data else None
        if not isinstance(value, dict):
            raise ProfileError(f"{self._where(key)}: expected a mapping, got {value!r}")
        return Fields(value, self.path, f"{self.prefix}{key}.")

    def reject_unknown(self, allowed) -> None:
        unknown = sorted(set(self.data) - set(allowed))
        if unknown:
            raise ProfileError(f"{self._where(unknown[0])}: unknown field (known: {', '.join(sorted(allowed))})")


def models_dir() -> Path:
    return PROFILES_DIR / "models"


def list_models() -> list[str]:
    return sorted(p.stem for p in models_dir().glob("*.yaml"))


def load_model(name_or_path: str) -> ModelProfile:
    """A model profile by key (``qwen3.5-9b``), display name (``Qwen3.5-9B``) or file path."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml") and "/" not in name_or_path:
        path = models_dir() / f"{name_or_path.lower()}.yaml"
        if not path.exists():
            raise ProfileError(f"model {name_or_path!r}: unknown (known: {', '.join(list_models())})")
    f = Fields(read_yaml(path), path)
    f.reject_unknown({"name", "hidden_size", "num_layers", "layers_per_attention", "vocab_size", "weights_gb",
                      "attention", "gdn", "ffn", "drafter"})
    attention = f.sub("attention")
    attention.reject_unknown({"num_heads", "num_kv_heads", "head_dim"})
    gdn = f.sub("gdn")
    gdn.reject_unknown({"num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_width"})
    ffn = f.sub("ffn")
    kind = ffn.get("kind", str)
    if kind == "dense":
        ffn.reject_unknown({"kind", "intermediate_size"})
        ffn_shape = FFNShape("dense", intermediate_size=ffn.get("intermediate_size", int))
    elif kind == "moe":
        ffn.reject_unknown({"kind", "num_experts", "top_k", "expert_intermediate_size", "shared_intermediate_size"})
        ffn_shape = FFNShape("moe", num_experts=ffn.get("num_experts", int), top_k=ffn.get("top_k", int),
                             expert_intermediate_size=ffn.get("expert_intermediate_size", int),
                             shared_intermediate_size=ffn.get("shared_intermediate_size", int))
    else:
        raise ProfileError(f"{path}: ffn.kind: expected 'dense' or 'moe', got {kind!r}")
    drafter = DrafterShape()
    if "drafter" in f.data:
        d = f.sub("drafter")
        d.reject_unknown({"kind", "layers"})
        kind = d.get("kind", str)
        if kind not in DRAFTER_KINDS:
            raise ProfileError(f"{path}: drafter.kind: expected one of {', '.join(DRAFTER_KINDS)}, got {kind!r}")
        drafter = DrafterShape(kind, d.get("layers", int))
    hk, hv = gdn.get("num_key_heads", int), gdn.get("num_value_heads", int)
    if hv % hk:
        raise ProfileError(f"{path}: gdn.num_value_heads: {hv} is not a multiple of num_key_heads {hk}")
    for name in ("key_head_dim", "value_head_dim"):  # a model the kernels cannot run is refused here, not in a launch
        size = gdn.get(name, int)
        if size not in SUPPORTED_HEAD_DIMS:
            raise ProfileError(f"{path}: gdn.{name}: {size} is not a head size the kernels support "
                               f"{SUPPORTED_HEAD_DIMS}")
    profile = ModelProfile(
        key=path.stem, name=f.get("name", str), hidden_size=f.get("hidden_size", int),
        num_layers=f.get("num_layers", int), layers_per_attention=f.get("layers_per_attention", int),
        vocab_size=f.get("vocab_size", int),
        attention=AttentionShape(attention.get("num_heads", int), attention.get("num_kv_heads", int),
                                 attention.get("head_dim", int)),
        gdn=HeadShape(hk=hk, hv=hv, dk=gdn.get("key_head_dim", int), dv=gdn.get("value_head_dim", int)),
        conv_width=gdn.get("conv_width", int),
        ffn=ffn_shape,
        drafter=drafter,
    )
    return profile


def resolve_model(name: str) -> ModelProfile:
    """`load_model`, also accepting the display name (case-insensitive)."""
    for key in list_models():
        if key == name.lower() or load_model(key).name.lower() == name.lower():
            return load_model(key)
    return load_model(name)
