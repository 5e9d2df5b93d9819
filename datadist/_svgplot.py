"""A dependency-free SVG line chart for the benchmark's ``--plot``: GB/s against block
size, one line per transport.  SVG renders in browsers and in Markdown viewers, so the
docs can show the figure without an image library on the machine that made it."""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

__all__ = ["line_chart"]

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
_W, _H, _L, _R, _T, _B = 640, 400, 70, 150, 40, 60


def _ticks(top: float) -> List[float]:
    """About five round tick values from 0 to at least ``top``."""
    raw = max(top, 1e-9) / 5
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * step:
            step *= m
            break
    return [i * step for i in range(int(math.ceil(top / step)) + 1)]


def line_chart(series: Dict[str, List[Tuple[float, float]]], title: str, xlabel: str, ylabel: str) -> str:
    """SVG text of ``series`` (name -> [(x, y)]), x on a log2 axis, y linear from 0."""
    xs = sorted({x for pts in series.values() for x, _ in pts})
    ymax = max((y for pts in series.values() for _, y in pts), default=1.0)
    yt = _ticks(ymax)
    lx = [math.log2(x) for x in xs]
    x0, x1 = (min(lx), max(lx)) if lx else (0.0, 1.0)
    span = (x1 - x0) or 1.0

    def px(x: float) -> float:
        return _L + (math.log2(x) - x0) / span * (_W - _L - _R)

    def py(y: float) -> float:
        return _H - _B - y / yt[-1] * (_H - _T - _B)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{_W / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>']
    for y in yt:
        out.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{_L - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{_H - _B + 18}" text-anchor="middle">{x:g}</text>')
    out.append(f'<text x="{(_L + _W - _R) / 2}" y="{_H - 15}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text transform="translate(18,{(_T + _H - _B) / 2}) rotate(-90)" text-anchor="middle">{ylabel}</text>')
    out.append(f'<rect x="{_L}" y="{_T}" width="{_W - _L - _R}" height="{_H - _T - _B}" fill="none" stroke="#333"/>')
    for i, (name, pts) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(pts))
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        ly = _T + 16 + 18 * i
        out.append(f'<line x1="{_W - _R + 12}" x2="{_W - _R + 32}" y1="{ly - 4}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="2"/><text x="{_W - _R + 38}" y="{ly}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)
