"""What the bench scripts share."""

from __future__ import annotations

import os


def write_results(text: str, path: str) -> None:
    """Replace a results file whole, so a reader never sees half a table."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
