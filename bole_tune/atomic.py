"""The one writer of every file the tool writes: atomic, keeping the file's mode, through symlinks.

A temporary file is written next to the file, fsynced and renamed over it, so a reader sees the old
file or the new one, never a part. What a plain ``open(path, "w")`` would keep is kept too:

- **mode**: an existing file keeps its permissions (and, where allowed, its group); a new file gets
  0666 less the umask, as any program's new file does (0644 under the usual umask 022), never the
  temporary file's private 0600, so a database shared between users or an export an engine reads
  stays readable to them.
- **symlinks**: a symlinked file is updated where the link points (the rename happens next to the
  target), so the link stays a link instead of becoming a private copy.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _umask() -> int:
    """This process's umask (read without changing it where Linux says it; else set and restored)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_target(path) -> Path:
    """The file a write to ``path`` replaces: ``path`` itself, or where its symlinks lead."""
    return Path(os.path.realpath(path))


def write_text_atomic(path, text: str, mode: int | None = None) -> None:
    """Replace ``path`` with ``text`` so that readers see the old file or the new one, never a part.

    ``mode``: the file's permissions (e.g. ``0o644``) when it must have these; without it an existing
    file keeps its own and a new one gets 0666 less the umask. A symlink is followed: its target is
    replaced, the link kept.
    """
    target = write_target(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = target.stat()
    except FileNotFoundError:
        old = None
    if mode is None:
        mode = stat.S_IMODE(old.st_mode) if old else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            os.fchmod(handle.fileno(), mode)
            if old is not None and old.st_gid != os.getegid():
                try:  # a shared database keeps its group where the writer belongs to it
                    os.fchown(handle.fileno(), -1, old.st_gid)
                except OSError:
                    pass
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # the rename itself survives a crash once the folder is synced
        folder = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)
