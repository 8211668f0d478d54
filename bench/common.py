"""What the bench scripts share."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import time


def finish(text: str, out: str, workdir: str, *, keep: bool, good: bool, data: dict | None = None) -> int:
    """Print and write the table (and its JSON twin); drop the run directories unless kept or a run failed."""
    print("\n" + text, end="", flush=True)
    write_results(text, out)
    print(f"[bench] table written to {os.path.relpath(out, os.getcwd())}", flush=True)
    if data is not None:
        path = write_json(data, out)
        print(f"[bench] JSON written to {os.path.relpath(path, os.getcwd())}", flush=True)
    if keep or not good:
        print(f"[bench] run directories and logs kept in {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if good else 1


def write_results(text: str, path: str) -> None:
    """Replace a results file whole, so a reader never sees half a table."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def json_path(txt_path: str) -> str:
    """The JSON twin of a table: same directory and name, .json (what service/report.py reads)."""
    return os.path.splitext(txt_path)[0] + ".json"


def write_json(data: dict, txt_path: str) -> str:
    path = json_path(txt_path)
    write_results(json.dumps(clean(data), indent=1, allow_nan=False, default=str) + "\n", path)
    return path


def host(load_before: list[float] | tuple, load_after: list[float] | tuple, packages=("torch",)) -> dict:
    """Where and when, for every figure drawn from the results: the txt header's facts, machine-readable."""
    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cores = os.cpu_count() or 1
    return {
        "hostname": platform.node() or "?",
        "cores": cores,
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores,
        "cpu": cpu_model(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": versions,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in load_after],
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def clean(value):
    """NaN (and inf) is not JSON: None instead, at any depth."""
    if isinstance(value, float):
        return value if abs(value) < float("inf") else None  # NaN fails the comparison too
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value
