"""What a data file on disk holds, told from its contents (no config, no heavy imports)."""

from __future__ import annotations

import os
import zipfile


def is_ctr_file(path: str) -> bool:
    """Whether ``path`` is a .npz in the CTR layout (has an ``ids`` or ``labels`` array)."""
    if not (path.endswith(".npz") and os.path.isfile(path)):
        return False
    try:
        with zipfile.ZipFile(path) as npz:
            arrays = {name.removesuffix(".npy") for name in npz.namelist()}
    except (OSError, zipfile.BadZipFile):
        return False
    return "ids" in arrays or "labels" in arrays
