"""Line charts as inline SVG, drawn on the server (no script, no chart library): a time axis with
clock ticks (UTC), a value axis from 0 with round ticks and its unit, a grid, one scale per chart
shared by its lines, and a legend. Only numbers and fixed words go into the markup, so nothing
needs escaping."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

WIDTH, HEIGHT = 520, 190
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 26, 30
_TIME_STEPS = (10, 30, 60, 120, 300, 600, 900, 1800, 3600)


@dataclass(frozen=True)
class Series:
    """One line: (Unix time, value or None for a gap)."""

    name: str
    colour: str
    points: list[tuple[float, float | None]]


def nice_step(top: float, ticks: int = 4) -> float:
    """A round step (1, 2 or 5 times a power of ten) that covers `top` in about `ticks` steps."""
    if top <= 0:
        return 1.0
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return float(factor * power)
    return float(10 * power)  # pragma: no cover - the loop always returns


def label(value: float, unit: str) -> str:
    """A value for an axis: 0, 12, 1.5k, 2.4M; 0.25/s; 90s as 1m30s."""
    if unit == "s" and value >= 60:
        minutes, seconds = divmod(int(value), 60)
        return (
            f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"
        )
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}{unit}"
    return f"{value:.3g}{unit}"


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S" if at % 60 else "%H:%M", time.gmtime(at))


def chart(
    title: str, unit: str, series: list[Series], *, now: float, window: float, summary: str = ""
) -> str:
    """A chart of `series` over the last `window` seconds to `now` (or since the first point,
    when that is younger)."""
    points = [p for s in series for p in s.points]
    first = min((at for at, _ in points), default=now - window)
    start = max(now - window, min(first, now - 60))
    span = max(now - start, 1.0)
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top_value = max((v for _, v in points if v is not None), default=0.0)
    step = nice_step(top_value)
    y_max = max(step * math.ceil(top_value / step), step)

    def x(at: float) -> float:
        return LEFT + max(0.0, at - start) / span * inner_w

    def y(value: float) -> float:
        return TOP + inner_h - value / y_max * inner_h

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'class="chart" role="img" aria-label="{title}">',
        f'<text x="{LEFT}" y="15" class="chart-title">{title}</text>',
    ]
    value = 0.0
    while value <= y_max + step / 2:  # the value axis: grid lines and labels
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
            'class="grid"/>'
            f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" class="tick" text-anchor="end">'
            f"{label(value, unit)}</text>"
        )
        value += step
    tick = next((t for t in _TIME_STEPS if span / t <= 6), _TIME_STEPS[-1])
    at = math.ceil(start / tick) * tick
    while at <= now:  # the time axis
        parts.append(
            f'<line x1="{x(at):.1f}" x2="{x(at):.1f}" y1="{TOP + inner_h}" '
            f'y2="{TOP + inner_h + 4}" class="axis"/>'
            f'<text x="{x(at):.1f}" y="{HEIGHT - 12}" class="tick" text-anchor="middle">'
            f"{_clock(at)}</text>"
        )
        at += tick
    parts.append(_frame(inner_h))
    for s in series:
        parts.extend(_line(s, x, y))
    parts.extend(_legend(series))
    if not points:
        parts.append(
            f'<text x="{LEFT + inner_w / 2}" y="{TOP + inner_h / 2}" class="tick" '
            'text-anchor="middle">no samples yet</text>'
        )
    if summary:
        parts.append(f"<desc>{summary}</desc>")
    parts.append("</svg>")
    return "".join(parts)


def _frame(inner_h: float) -> str:
    """The two axes and the time axis's name."""
    return (
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + inner_h}" y2="{TOP + inner_h}" '
        f'class="axis"/><line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + inner_h}" '
        'class="axis"/>'
        f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 1}" class="tick" text-anchor="end">'
        "time (UTC)</text>"
    )


def _legend(series: list[Series]) -> list[str]:
    """Each series' name in its colour, right-aligned along the top."""
    parts = []
    legend_x = float(WIDTH - RIGHT)
    for s in reversed(series):
        parts.append(
            f'<text x="{legend_x}" y="15" class="legend" fill="{s.colour}" '
            f'text-anchor="end">■ {s.name}</text>'
        )
        legend_x -= 22 + 6.5 * len(s.name)
    return parts


def _line(series: Series, x: Callable[[float], float], y: Callable[[float], float]) -> list[str]:
    """One polyline per run of points without a gap (a point alone: a dot)."""
    runs: list[list[str]] = [[]]
    for at, value in series.points:
        if value is None:
            runs.append([])
        else:
            runs[-1].append(f"{x(at):.1f},{y(value):.1f}")
    drawn = []
    for run in runs:
        if len(run) == 1:
            cx, cy = run[0].split(",")
            drawn.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{series.colour}"/>')
        elif run:
            points = " ".join(run)
            drawn.append(
                f'<polyline fill="none" stroke="{series.colour}" stroke-width="2" '
                f'points="{points}"/>'
            )
    return drawn
