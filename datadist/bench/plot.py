"""``datadist.bench --plot``: the rows a run measured, drawn with matplotlib (extra
``[plot]``), as PNG and SVG.  A sweep (rows of one workload family at several block sizes)
is GB/s against block size, one line per system plus the raw copy; any other selection is
GB/s per workload, one bar per system, with the raw copy of each workload marked."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["plot_rows"]

#: One row of :mod:`datadist.bench.record`.
Row = Dict[str, Any]


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, with text kept as text in SVGs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: searchable, smaller
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'datadist[plot]'") from None
    return plt


def _sweep(ax: Any, moved: Sequence[Row], systems: Sequence[str]) -> None:
    """GB/s against block size, one line per system plus the raw copy."""
    for system in systems:
        pts = sorted((r["block_kib"], r["gbps"]) for r in moved if r["system"] == system)
        ax.plot(*zip(*pts), marker="o", label=system)
    raw = sorted({r["block_kib"]: r["raw_copy_gbps"] for r in moved}.items())
    ax.plot(*zip(*raw), linestyle="--", color="grey", label="raw copy (same run)")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["block_kib"] for r in moved})
    ax.set_xticks(sizes, [str(k) for k in sizes])
    ax.set_xlabel("block size (KiB)")


def _bars(ax: Any, moved: Sequence[Row], workloads: Sequence[str], systems: Sequence[str]) -> None:
    """GB/s per workload, one bar per system, the raw copy of each workload marked."""
    width = 0.8 / max(len(systems), 1)
    by: Dict[Tuple[str, str], float] = {(r["workload"], r["system"]): r["gbps"] for r in moved}
    for i, system in enumerate(systems):
        xs = [k + i * width for k in range(len(workloads))]
        ax.bar(xs, [by.get((w, system), 0.0) for w in workloads], width, label=system)
    raw = {r["workload"]: r["raw_copy_gbps"] for r in moved}
    ax.scatter([k + 0.4 - width / 2 for k in range(len(workloads))], [raw[w] for w in workloads],
               marker="_", s=400, color="black", label="raw copy (same run)", zorder=3)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(workloads))], workloads)


def plot_rows(rows: Sequence[Row], out: str, title: str) -> List[str]:
    """Draw ``rows`` (:mod:`datadist.bench.record` records) into ``out`` with both the
    ``.png`` and the ``.svg`` suffix; returns the files written.  Raises ``ImportError``
    naming the extra when matplotlib is missing."""
    plt = _pyplot()
    moved = [r for r in rows if r.get("gbps")]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    workloads: List[str] = list(dict.fromkeys(r["workload"] for r in moved))
    systems: List[str] = list(dict.fromkeys(r["system"] for r in moved))
    if all(w.startswith("sweep-") for w in workloads):
        _sweep(ax, moved, systems)
    else:
        _bars(ax, moved, workloads, systems)
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    stem = Path(out).with_suffix("")
    written = []
    for suffix in (".png", ".svg"):
        fig.savefig(stem.with_suffix(suffix))
        written.append(str(stem.with_suffix(suffix)))
    plt.close(fig)
    return written
