"""Charts of benchmark runs, drawn by matplotlib (``pip install 'butter-core[bench]'``)
into a PNG or SVG (the file's suffix says which).

:func:`plot`: tokens/s and time to first token against lanes, one line per server or
setting. ``butter serve-bench --plot FILE`` draws its own run; the ``bench/`` scripts
draw several servers' runs on the same axes. :func:`bars`: setups side by side at one
load (``bench/scale_out.py``), one panel per figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs


@attrs.frozen
class Point:
    """One concurrency level of one server or setting."""

    lanes: int
    tokens_per_s: float | None  # completion tokens per second, every lane together
    ttft_s: float | None  # median time to first token, seconds


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display, no GUI toolkit
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("charts need matplotlib: pip install 'butter-core[bench]'") from exc
    return plt


def _save(plt, figure, path: Path, title: str) -> Path:
    """Title ``figure``, write it to ``path`` (its folder made) and close it."""
    if title:
        figure.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot(series: Mapping[str, Sequence[Point]], path: Path, *, title: str = "") -> Path:
    """Draw ``series`` (label: its points) as two panels, tokens/s and TTFT against
    lanes, into ``path``; raise ``RuntimeError`` if matplotlib is not installed."""
    plt = _pyplot()
    figure, (speed, ttft) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    lanes: set[int] = set()
    for label, points in series.items():
        points = sorted(points, key=lambda p: p.lanes)
        lanes.update(p.lanes for p in points)
        style = "--" if "off" in label or "none" in label or "default" in label else "-"
        for axis, value in ((speed, lambda p: p.tokens_per_s),
                            (ttft, lambda p: None if p.ttft_s is None else p.ttft_s * 1000)):
            shown = [(p.lanes, value(p)) for p in points if value(p) is not None]
            if shown:
                axis.plot(*zip(*shown), style, marker="o", label=label)
    speed.set(xlabel="lanes (concurrent requests)", ylabel="completion tokens/s",
              title="throughput (higher is better)")
    ttft.set(xlabel="lanes (concurrent requests)", ylabel="TTFT p50 (ms)",
             title="time to first token (lower is better)")
    for axis in (speed, ttft):
        axis.set_xticks(sorted(lanes))
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    speed.legend(fontsize="small")
    return _save(plt, figure, path, title)


def bars(setups: Mapping[str, Mapping[str, float | None]], panels: Sequence[tuple[str, str]],
         path: Path, *, title: str = "") -> Path:
    """Draw one panel per ``(figure key, axis label)`` in ``panels``, one bar per setup
    (``setups``: label -> its figures; a missing or None figure leaves a gap), into
    ``path``; raise ``RuntimeError`` if matplotlib is not installed."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 4.2),
                                constrained_layout=True, squeeze=False)
    labels = list(setups)
    for axis, (key, name) in zip(axes[0], panels):
        values = [setups[label].get(key) for label in labels]
        drawn = axis.bar(range(len(labels)), [v or 0 for v in values],
                         color=[f"C{i}" for i in range(len(labels))])
        axis.bar_label(drawn, labels=["" if v is None else f"{v:.3g}" for v in values],
                       fontsize="small")
        axis.set_xticks(range(len(labels)), labels, rotation=30, ha="right",
                        fontsize="small")
        axis.set(title=name)
        axis.grid(axis="y", alpha=0.3)
    return _save(plt, figure, path, title)
