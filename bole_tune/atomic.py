"""Files the tool writes are written atomically: a temporary file in the same folder, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
