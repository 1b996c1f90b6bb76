"""`butter serve-bench --plot` and the bench scripts' chart: a real PNG or SVG with one
line per server or setting."""

from __future__ import annotations

import pytest

from butter.bench import serve_bench
from butter.bench.plot import Point, bars, plot

pytest.importorskip("matplotlib")


def test_a_chart_of_several_servers_is_a_png_or_an_svg(tmp_path):
    series = {"butter speculation on": [Point(1, 210.0, 0.05), Point(4, 400.0, 0.09)],
              "butter speculation off": [Point(1, 150.0, 0.05), Point(4, 380.0, 0.08)],
              "llama-server default": [Point(1, 160.0, 0.04), Point(4, None, None)]}
    png = plot(series, tmp_path / "chart.png", title="quote")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    svg = plot(series, tmp_path / "sub" / "chart.svg").read_text()
    assert "<svg" in svg and "llama-server default" in svg


def test_serve_bench_levels_become_points():
    config = serve_bench.BenchConfig(model="smollm2", concurrency=(1, 8))
    report = serve_bench.BenchReport(config, [
        serve_bench.LevelSummary(concurrency=1, waves=1, completion_tok_s=120.0, ttft_p50=0.1),
        serve_bench.LevelSummary(concurrency=8, waves=1, completion_tok_s=400.0, ttft_p50=0.3)])
    assert serve_bench.chart_points(report) == [Point(1, 120.0, 0.1), Point(8, 400.0, 0.3)]


def test_setups_side_by_side_are_bars_with_their_values(tmp_path):
    setups = {"one process": {"tok_s": 3.7, "hit": 0.65},
              "affinity": {"tok_s": 8.6, "hit": 0.65},
              "power of two": {"tok_s": 6.3, "hit": None}}
    svg = bars(setups, [("tok_s", "completion tokens/s"), ("hit", "prefix-hit rate")],
               tmp_path / "bars.svg", title="scale-out").read_text()
    assert "power of two" in svg and "prefix-hit rate" in svg and "scale-out" in svg
    png = bars(setups, [("tok_s", "tokens/s")], tmp_path / "bars.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
