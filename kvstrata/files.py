"""Where kvstrata keeps what it makes on first use, and how files are written so a reader never sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def calibration_dir(kind: str) -> Path:
    """Where calibrations made on first use are kept: $KVSTRATA_CACHE_DIR (as for converted models), else
    $XDG_CACHE_HOME/kvstrata, else ~/.cache/kvstrata; then `kind`/ (oaken, infinigen)."""
    if os.environ.get("KVSTRATA_CACHE_DIR"):
        return Path(os.environ["KVSTRATA_CACHE_DIR"]) / kind
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # XDG: a relative path is ignored
    return base / "kvstrata" / kind


def write_atomically(path: str | Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it into place (raises OSError)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
