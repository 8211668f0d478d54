"""What the bench scripts share."""

from __future__ import annotations

import os
import shutil


def finish(text: str, out: str, workdir: str, *, keep: bool, good: bool) -> int:
    """Print and write the table; drop the run directories unless kept or a run failed."""
    print("\n" + text, end="", flush=True)
    write_results(text, out)
    print(f"[bench] table written to {os.path.relpath(out, os.getcwd())}", flush=True)
    if keep or not good:
        print(f"[bench] run directories and logs kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if good else 1


def write_results(text: str, path: str) -> None:
    """Replace a results file whole, so a reader never sees half a table."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
