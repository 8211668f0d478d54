"""`etrain report`: an HTML page with PNG plots of what distribution bought and cost.

Reads the JSON the bench scripts write next to their tables (bench/results/*.json) and
writes <out>/report.html with one PNG per figure beside it. A figure whose data is not in
the results is listed as "not measured in this run", never an error. Every figure says
the machine and the time of the run it was drawn from.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Replicated (every worker holds all weights) against sharded, for the memory figure.
REPLICATED = ("ddp",)
SHARDED = ("fsdp", "hsdp")
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]


class ReportError(Exception):
    """No results to draw from: the caller says so in one line."""


class NotMeasured(Exception):
    """This figure's data is not in the results; the message says what to run."""


@dataclass
class Figure:
    file: str
    title: str
    shows: str  # the one line under the figure
    bench: str  # whose JSON it is drawn from
    draw: Callable


# ---------------------------------------------------------------- reading


def load_results(results_dir: Path) -> dict[str, dict]:
    """The newest JSON per bench; a full run wins over a --quick one whatever their age."""
    if not results_dir.is_dir():
        raise ReportError(f"no results directory {results_dir} (run ./run bench, or pass --results DIR)")
    found: dict[str, dict] = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # not ours, or half written by a bench that died: skip, not fail
        if not isinstance(data, dict) or not isinstance(data.get("bench"), str) or "host" not in data:
            continue
        data["_file"] = path.name
        rank = (not data.get("quick"), data["host"].get("utc") or "")
        old = found.get(data["bench"])
        if old is None or rank > (not old.get("quick"), old["host"].get("utc") or ""):
            found[data["bench"]] = data
    if not found:
        raise ReportError(f"no bench results (JSON) in {results_dir}; run the benches first (./run bench)")
    return found


def where_when(data: dict) -> str:
    h = data["host"]
    versions = ", ".join(f"{k} {v}" for k, v in (h.get("versions") or {}).items() if v)
    load = f"load avg {_load(h.get('load_avg_before'))} before, {_load(h.get('load_avg_after'))} after"
    when = (h.get("utc") or "?").replace("T", " ").replace("Z", " UTC")
    quick = "  |  QUICK MODE: tiny model, a smoke test" if data.get("quick") else ""
    return (f"measured on {h.get('hostname', '?')}, {h.get('cores', '?')} cores ({h.get('cpu', '?')}), "
            f"python {h.get('python', '?')}, {versions}\n{when}; {load}{quick}")


def _load(values) -> str:
    return f"{values[0]:.2f}" if values else "?"


def _rows(data: dict) -> list[dict]:
    return [r for r in data.get("rows") or [] if r.get("status") in ("ok", "async failed")]


# ---------------------------------------------------------------- figures


def _new(rows: int = 1, cols: int = 1, width: float = 9.0):
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(width, 5.2), dpi=110)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    return fig, list(axes)


def _grouped_bars(ax, groups: list[str], series: dict[str, list], colors=None, fmt="{:.0f}") -> None:
    """Bars per group, one per series; a missing value leaves a gap, not a zero bar."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        pairs = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not pairs:
            continue
        bars = ax.bar([x for x, _ in pairs], [v for _, v in pairs], width * 0.95, label=label,
                      color=(colors or COLORS)[i % len(colors or COLORS)])
        ax.bar_label(bars, labels=[fmt.format(v) for _, v in pairs], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups)
    top = max((v for vs in series.values() for v in vs if v is not None), default=1)
    ax.set_ylim(0, top * 1.3)  # headroom: the legend goes above the bars, never over one
    ax.legend(fontsize=8, loc="upper left", ncol=n)


def speedup(data: dict):
    rows = [r for r in _rows(data) if r.get("speedup") is not None]
    if not rows:
        raise NotMeasured("no speed-up rows in parallel_gpt.json: run python bench/parallel_gpt.py")
    fig, (ax,) = _new()
    configs = list(dict.fromkeys(r["config"] for r in rows))
    workers = sorted({r["workers"] for r in rows})
    for i, name in enumerate(configs):
        mine = sorted((r for r in rows if r["config"] == name), key=lambda r: r["workers"])
        other_base = any(r.get("speedup_over") != f"{name} 1 worker" for r in mine)
        ax.plot([r["workers"] for r in mine], [r["speedup"] for r in mine], marker="o", color=COLORS[i % 9],
                linestyle=":" if other_base else "-", label=name + (" (over ddp 1 worker)" if other_base else ""))
    ax.plot(workers, workers, color="grey", linestyle="--", linewidth=1, label="linear (ideal)")
    cores = data["host"].get("cores")
    if cores and cores < max(workers):
        ax.axvline(cores, color="grey", linewidth=0.8)
        ax.text(cores, ax.get_ylim()[1] * 0.98, f" {cores} cores", va="top", fontsize=8, color="grey")
    ax.set_xticks(workers)
    ax.set_xlabel("workers (processes)")
    ax.set_ylabel("speed-up (samples/s over 1 worker, x)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def comm_share(data: dict):
    rows = [r for r in _rows(data) if r["workers"] > 1 and r.get("comm_pct_mean") is not None]
    if not rows:
        raise NotMeasured("no multi-worker rows with a profiled communication share in parallel_gpt.json")
    fig, (ax,) = _new()
    configs = list(dict.fromkeys(r["config"] for r in rows))
    workers = sorted({r["workers"] for r in rows})
    get = {(r["config"], r["workers"]): r["comm_pct_mean"] for r in rows}
    _grouped_bars(ax, configs, {f"{w} workers": [get.get((c, w)) for c in configs] for w in workers})
    ax.set_ylabel("step time in gloo collectives (%, mean over ranks)")
    ax.tick_params(axis="x", labelsize=8, rotation=20)
    return fig


def peak_memory(data: dict):
    rows = [r for r in _rows(data) if r.get("peak_rss_mb") is not None and r.get("precision", "fp32") == "fp32"
            and r["config"] in REPLICATED + SHARDED]
    if not {r["config"] for r in rows} & set(REPLICATED) or not {r["config"] for r in rows} & set(SHARDED):
        raise NotMeasured("needs ddp (replicated) and fsdp or hsdp (sharded) rows in parallel_gpt.json: "
                          "python bench/parallel_gpt.py --strategies ddp fsdp hsdp")
    fig, (ax,) = _new()
    workers = sorted({r["workers"] for r in rows})
    get = {(r["config"], r["workers"]): r["peak_rss_mb"] for r in rows}
    configs = [c for c in REPLICATED + SHARDED if any(k[0] == c for k in get)]
    labels = {c: f"{c} ({'replicated' if c in REPLICATED else 'sharded'})" for c in configs}
    _grouped_bars(ax, [f"{w} worker{'s' * (w > 1)}" for w in workers],
                  {labels[c]: [get.get((c, w)) for w in workers] for c in configs})
    ax.set_ylabel("peak RSS per worker (MB)")
    return fig


def checkpoint_blocking(data: dict):
    rows = [r for r in _rows(data) if r.get("ckpt_blocked_sync_s") is not None and r.get("precision") == "fp32"]
    if not any(r.get("ckpt_blocked_async_s") is not None for r in rows):
        raise NotMeasured("no async checkpoint rows in parallel_gpt.json (every strategy but ddp has one): "
                          "python bench/parallel_gpt.py --strategies fsdp")
    fig, (ax,) = _new(width=max(10.0, 0.6 * len(rows)))  # the full bench has ~20 groups
    crowded = len(rows) > 10  # long names side by side overlap: slant them instead
    groups = [f"{r['config']}{' ' if crowded else chr(10)}{r['workers']}w" for r in rows]
    _grouped_bars(ax, groups, {"sync (foreground)": [r["ckpt_blocked_sync_s"] for r in rows],
                               "async (background)": [r.get("ckpt_blocked_async_s") for r in rows]},
                  colors=["#d62728", "#2ca02c"], fmt="{:.2f}")
    ax.set_ylabel("training blocked per checkpoint (s, median)")
    if crowded:
        ax.tick_params(axis="x", labelsize=8, rotation=35)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    return fig


def recovery(data: dict):
    bars = []  # (label, recovery s, steps recomputed)
    names = {"ray": "Ray Train", "torchrun": "torchrun"}
    for system, d in (data.get("systems") or {}).items():
        for r in d.get("recovery") or []:
            if r.get("recovery_s") is not None:
                bars.append((f"{names.get(system, system)}\n{r.get('mode', 'exact')}", r["recovery_s"],
                             r.get("lost_steps")))
    if not bars:
        raise NotMeasured("no recovery rows in vs_torchrun.json: python bench/vs_torchrun.py (needs Ray, minutes)")
    fig, (left, right) = _new(1, 2)
    colors = [COLORS[i % 9] for i in range(len(bars))]
    for ax, i, label, fmt in ((left, 1, "recovery: failure to next step (s)", "{:.1f}"),
                              (right, 2, "steps recomputed per failure", "{:.0f}")):
        pairs = [(b[0], b[i], c) for b, c in zip(bars, colors) if b[i] is not None]
        rects = ax.bar([p[0] for p in pairs], [p[1] for p in pairs], color=[p[2] for p in pairs], width=0.6)
        ax.bar_label(rects, labels=[fmt.format(p[1]) for p in pairs], fontsize=8, padding=2)
        ax.set_ylabel(label)
        ax.margins(y=0.15)
    job = data.get("job") or {}
    if job.get("crash_step"):
        right.set_title(f"rank 1 killed at step {job['crash_step']}, checkpoint every {job.get('checkpoint_every')}",
                        fontsize=8)
    return fig


def mixed_precision(data: dict):
    rows = _rows(data)
    low = [r for r in rows if r.get("precision", "fp32") != "fp32" and r.get("samples_per_s")]
    fp32 = {(r["strategy"], r["workers"]): r for r in rows if r.get("precision", "fp32") == "fp32"}
    pairs = [(fp32[(r["strategy"], r["workers"])], r) for r in low if (r["strategy"], r["workers"]) in fp32]
    if not pairs:
        raise NotMeasured("no bf16 rows with an fp32 twin in parallel_gpt.json: "
                          "python bench/parallel_gpt.py --strategies ddp ddp-bf16")
    fig, (left, right) = _new(1, 2)
    groups = [f"{a['strategy']} {a['workers']}w" for a, _ in pairs]
    precisions = list(dict.fromkeys(b["precision"] for _, b in pairs))
    for ax, key, label in ((left, "samples_per_s", "samples/s"), (right, "peak_rss_mb", "peak RSS per worker (MB)")):
        series = {"fp32": [a.get(key) for a, _ in pairs]}
        for p in precisions:
            series[f"{p} autocast"] = [b.get(key) if b["precision"] == p else None for _, b in pairs]
        _grouped_bars(ax, groups, series, colors=["#1f77b4", "#9467bd", "#8c564b"])
        ax.set_ylabel(label)
    return fig


OVERSUBSCRIBED = ("{most} worker processes share {cores} cores here: the CPU is oversubscribed, so a speed-up "
                  "above {cores}x is impossible and the figures mostly show each strategy's overheads.")

FIGURES = [
    Figure("speedup.png", "Speed-up against worker count",
           "Samples/s of each strategy over the same strategy on 1 worker (dotted: over ddp on 1 worker, where the "
           "configuration has no 1-worker form); the dashed line is linear scaling.", "parallel_gpt", speedup),
    Figure("comm_share.png", "Share of step time spent communicating",
           "Per rank, the time inside gloo collectives over the wall time of the profiled steps, mean over ranks. "
           "On CPU a collective's time includes waiting for slower peers.", "parallel_gpt", comm_share),
    Figure("peak_memory.png", "Peak memory per worker: sharded against replicated",
           "Largest per-worker peak RSS: ddp keeps a full copy of weights and optimizer state on every worker, fsdp "
           "and hsdp shard them. RSS includes the Python and torch runtime, so compare bars rather than read "
           "them as model memory.", "parallel_gpt", peak_memory),
    Figure("checkpoint_blocking.png", "Checkpoint blocking time: sync against async",
           "Median seconds training waited for a checkpoint, written in the foreground (sync) or staged to CPU "
           "memory and written in the background (async; ddp has no background path).",
           "parallel_gpt", checkpoint_blocking),
    Figure("recovery.png", "Recovery per failure: Ray Train against torchrun",
           "One worker SIGKILLed mid-run: seconds from the failure to the next completed step, and the steps "
           "recomputed since the newest checkpoint. Exact: resumed from the checkpoint, same weights as an "
           "undisturbed run; live recovery appears here once the bench measures it.", "vs_torchrun", recovery),
    Figure("mixed_precision.png", "Mixed precision against fp32",
           "ddp in bf16 autocast (fp32 weights) against ddp in fp32 on as many workers: samples/s and peak memory. "
           "CPUs without native bf16 may well run it slower.", "parallel_gpt", mixed_precision),
]


# ---------------------------------------------------------------- writing


def build(results_dir: Path, out_dir: Path) -> Path:
    """Write out_dir/report.html and its PNGs; the HTML's path."""
    results = load_results(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for f in FIGURES:
        data = results.get(f.bench)
        try:
            if data is None:
                raise NotMeasured(f"no {f.bench}.json in {results_dir}: run python bench/{f.bench}.py")
            fig = f.draw(data)
        except NotMeasured as e:
            (out_dir / f.file).unlink(missing_ok=True)  # a stale PNG from an older report would mislead
            sections.append(_missing(f, str(e)))
            continue
        fig.suptitle(f.title, fontsize=12, fontweight="bold")
        fig.text(0.01, 0.01, where_when(data), fontsize=7, color="#444", va="bottom")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        fig.savefig(out_dir / f.file)
        sections.append(_section(f, data))
    path = out_dir / "report.html"
    path.write_text(_page(results, sections))
    return path


def _caveat(data: dict) -> str:
    notes = []
    if data.get("quick"):
        notes.append("Quick mode: a tiny model and a few steps, a smoke test of the bench; the figures are not "
                     "meaningful, only the method.")
    rows = data.get("rows") or []
    cores = data["host"].get("cores") or 0
    most = max((r["workers"] for r in rows if r.get("workers")), default=0)
    if most > cores:
        notes.append(OVERSUBSCRIBED.format(most=most, cores=cores))
    if data.get("bench") == "vs_torchrun":
        notes.append("Timings on a busy machine are noisy; the load average above says how busy it was.")
    return " ".join(notes)


def _section(f: Figure, data: dict) -> str:
    caveat = _caveat(data)
    e = html.escape
    return (f'<section><h2>{e(f.title)}</h2>\n<img src="{e(f.file)}" alt="{e(f.title)}">\n'
            f"<p>{e(f.shows)}</p>\n" + (f'<p class="caveat">{e(caveat)}</p>\n' if caveat else "")
            + f'<p class="where">{e(where_when(data))} (from {e(data["_file"])})</p></section>')


def _missing(f: Figure, why: str) -> str:
    e = html.escape
    return (f'<section class="missing"><h2>{e(f.title)}</h2>\n<p><strong>not measured in this run</strong>: '
            f"{e(why)}</p></section>")


def _page(results: dict, sections: list[str]) -> str:
    e = html.escape
    sources = "".join(f"<li>{e(d['_file'])}: {e(where_when(d))}</li>" for d in results.values())
    body = "\n".join(sections)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>elastic-train: what distribution bought and cost</title>
<style>
body {{ font-family: sans-serif; max-width: 1000px; margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.4; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
section {{ margin-bottom: 2.5em; }}
.caveat {{ color: #8a4b00; }}
.where {{ color: #666; font-size: 0.85em; white-space: pre-line; }}
.missing {{ color: #666; }}
</style></head><body>
<h1>elastic-train: what distribution bought and cost on this machine</h1>
<p>Drawn by <code>etrain report</code> from the JSON the benches in <code>bench/</code> wrote:</p>
<ul class="where">{sources}</ul>
{body}
</body></html>
"""
