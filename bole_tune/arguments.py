"""What the command line accepts, checked where it enters, before any long work starts.

Numbers: argparse types with a range (`integer`, `integers`); the bounds are named here and, for the
random trees, in `bole_tune.workloads` (`MAX_TREE_SIZE`, `MAX_BATCH`). Output paths: `check_output`,
called by every command that writes a file or a folder before it measures anything, so a bad path never
costs a result; `write_or_rescue` writes results and, should the path fail anyway, keeps them in a
temporary file and says where. Every error names the flag.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from bole_tune.atomic import write_text_atomic

MIN_REPEATS, MAX_REPEATS = 3, 10_000
"""Timed replays per measurement: p20/p50/p80 need three; 10^4 already takes minutes per case."""

MAX_CONTEXT = 1 << 20
"""KV tokens of `step`'s attention layers: 4x Qwen3.5's native 262,144-token context."""

MAX_TREE_DEPTH = 64
"""Edges from a root of `bench`'s random trees: draft trees are 3-16 deep, budgets search up to 8."""

def _bounded(text: str, low: int, high: int | None) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low or (high is not None and value > high):
        within = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise argparse.ArgumentTypeError(f"expected an integer {within}, got {value}")
    return value


def integer(low: int = 1, high: int | None = None):
    """An argparse type: one int in [low, high]."""
    def parse(text: str) -> int:
        return _bounded(text, low, high)
    return parse


def integers(high: int | None = None):
    """An argparse type: positive ints separated by commas or spaces, each at most ``high``."""
    def parse(text: str) -> list[int]:
        items = text.replace(",", " ").split()
        if not items:
            raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
        return [_bounded(item, 1, high) for item in items]
    return parse


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number), got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if parent.exists() or parent.is_symlink():
            return parent
    return Path(".")


def check_output(path, flag: str, folder: bool = False) -> Path:
    """``path`` if the command can write it there: a file (``folder`` False) or a folder; missing folders on
    the way are created when written, as ``mkdir -p`` would. A ValueError naming ``flag`` otherwise: a folder
    where a file is wanted or the reverse, a file where a folder must be created, a folder it cannot write."""
    path = Path(path)
    if path.is_dir() and not folder:
        raise ValueError(f"{flag}: {path} is a folder, expected a file name")
    if path.exists() and not path.is_dir() and folder:
        raise ValueError(f"{flag}: {path} is a file, expected a folder")
    if path.exists() and not folder and not path.is_file():
        raise ValueError(f"{flag}: {path} is not a regular file")
    existing = _nearest_existing(path if folder else path.parent)
    if not existing.is_dir():
        raise ValueError(f"{flag}: {existing} is a file, so {path} cannot be created in it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: cannot write in the folder {existing} (permission denied)")
    return path


def check_outputs(args, **flags) -> None:
    """`check_output` for each of a command's output flags given in ``args`` (an argparse namespace):
    ``flags`` maps an attribute name (``db_dir``) to True for a folder, False for a file."""
    for name, folder in flags.items():
        value = getattr(args, name, None)
        if value is not None:
            check_output(value, f"--{name.replace('_', '-')}", folder)


def write_or_rescue(path, text: str, flag: str) -> None:
    """Write ``text`` to ``path`` atomically; if that fails, write it to a temporary file instead and raise a
    ValueError naming ``flag``, the error and where the text is."""
    try:
        write_text_atomic(path, text)
    except OSError as error:
        fd, rescue = tempfile.mkstemp(prefix="bole-tune-", suffix=Path(path).suffix or ".txt")
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        raise ValueError(f"{flag}: cannot write {path} ({error.strerror or error}); the results are in {rescue}") \
            from None
