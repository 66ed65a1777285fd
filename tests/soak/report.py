"""The soak's report: a plain-text summary and one self-contained HTML page with an SVG
timeline (faults per lane, throughput per role, errors and restarts), built from the run's
summary and the JSON-lines events the runner wrote. Pure Python, no servers, no scripts."""

from __future__ import annotations

import html
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUCKET_SECONDS = 5.0
DETAIL_LINES = 12
HTML_DETAIL_LINES = 200

KIND_COLOURS = (
    "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#393b79", "#637939",
)  # fmt: skip
ROLE_COLOURS = ("#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#e377c2")
FAMILY_COLOURS = {
    "retriable": "#f0a30a",
    "recoverable": "#1f77b4",
    "heuristic": "#9467bd",
    "fatal": "#d62728",
    "foreign": "#333333",
}
OTHER_FAMILY_COLOUR = "#999999"

# SVG geometry, in px: readable at about 1200 px wide.
WIDTH = 1200
LEFT = 150
RIGHT = 20
LANE_HEIGHT = 22
THROUGHPUT_HEIGHT = 56
ERROR_ROW_HEIGHT = 18
GAP = 26


@dataclass
class SoakSummary:
    """What a soak run counted; ``ok`` only when every anomaly count is 0."""

    seed: int
    seconds: float
    minutes_planned: float
    faults: Counter[str] = field(default_factory=Counter)
    transactions: dict[str, int] = field(default_factory=dict)
    errors: dict[str, Counter[str]] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    daemon_passes: dict[str, int] = field(default_factory=dict)
    anomalies: dict[str, int] = field(default_factory=dict)
    details: dict[str, list[str]] = field(default_factory=dict)
    figures: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(count == 0 for count in self.anomalies.values())


def load_events(path: Path) -> list[dict[str, Any]]:
    """The events of a JSON-lines file; a last line cut short (the runner killed mid-write)
    is skipped, a bad line anywhere else is an error."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    events: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line: {line[:80]!r}") from None
        if not isinstance(event, dict):
            raise ValueError(f"{path}:{number}: not a JSON object: {line[:80]!r}")
        events.append(event)
    return events


# --- reading events -------------------------------------------------------------------------


def _num(event: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def _str(event: Mapping[str, Any], key: str) -> str:
    value = event.get(key)
    return "" if value is None else str(value)


def _of(events: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [event for event in events if event.get("e") == kind]


def _times(event: Mapping[str, Any]) -> list[float]:
    keys = ("start", "end") if event.get("e") == "fault" else ("t",)
    return [float(event[key]) for key in keys if isinstance(event.get(key), int | float)]


def _span(summary: SoakSummary, events: list[dict[str, Any]]) -> tuple[float, float]:
    """The run's start (a ``start`` event's t if any, else the earliest time stamp) and its
    length in seconds (the summary's run time, stretched to cover every event)."""
    stamps = [stamp for event in events for stamp in _times(event)]
    starts = [_num(event, "t") for event in _of(events, "start") if "t" in event]
    t0 = starts[0] if starts else min(stamps, default=0.0)
    last = max(stamps, default=t0)
    return t0, max(summary.seconds, last - t0, 1.0)


def _faults(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(
        _of(events, "fault"), key=lambda event: (_num(event, "start"), _str(event, "lane"))
    )


def _duration(fault: Mapping[str, Any]) -> float:
    return max(0.0, _num(fault, "end") - _num(fault, "start"))


def _ordered(first: Iterable[str], then: Iterable[str]) -> list[str]:
    """Names from ``first`` in their order, then the new ones of ``then`` sorted."""
    names = list(dict.fromkeys(first))
    return names + sorted(set(then) - set(names))


def _roles(summary: SoakSummary, events: list[dict[str, Any]]) -> list[str]:
    seen = {
        _str(event, "role") for event in events if event.get("e") in ("done", "error", "restart")
    }
    return _ordered([*summary.transactions, *summary.errors, *summary.restarts], seen)


# --- text -----------------------------------------------------------------------------------


def _minutes(seconds: float) -> str:
    return f"{seconds:.1f} s ({seconds / 60:.1f} min)"


def _header(summary: SoakSummary) -> list[tuple[str, str]]:
    bad = sum(1 for count in summary.anomalies.values() if count)
    by_kind = ", ".join(f"{kind} {count}" for kind, count in sorted(summary.faults.items()))
    rows = [
        ("result", "OK" if summary.ok else f"FAILED ({bad} anomal{'y' if bad == 1 else 'ies'})"),
        ("seed", str(summary.seed)),
        ("run time", f"{_minutes(summary.seconds)}, planned {summary.minutes_planned:g} min"),
        ("faults", f"{sum(summary.faults.values())}" + (f" ({by_kind})" if by_kind else "")),
        ("transactions", _pairs(summary.transactions)),
        ("restarts", _pairs(summary.restarts)),
        ("daemon passes", _pairs(summary.daemon_passes)),
    ]
    return rows + sorted(summary.figures.items())


def _pairs(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {count}" for name, count in counts.items()) or "-"


def render_text(summary: SoakSummary, events: list[dict[str, Any]]) -> str:
    """The plain report: header, errors by class per role, anomalies, details, fault timeline."""
    out = ["soak report", "==========="]
    rows = _header(summary)
    width = max(len(name) for name, _ in rows)
    out += [f"{name.ljust(width)}  {value}" for name, value in rows]

    out += ["", "errors by class per role"]
    error_roles = [role for role, classes in summary.errors.items() if classes]
    if not error_roles:
        out.append("  (none)")
    for role in error_roles:
        classes = summary.errors[role]
        out.append(f"  {role}: {sum(classes.values())}")
        out += [f"    {count:>8}  {name}" for name, count in classes.most_common()]

    out += ["", "anomalies (each must be 0)"]
    if not summary.anomalies:
        out.append("  (none counted)")
    for name, count in summary.anomalies.items():
        verdict = "ok" if count == 0 else "FAIL"
        out.append(f"  {verdict:<4}  {name}: {count} (must be 0)")

    for name, lines in summary.details.items():
        more = len(lines) - DETAIL_LINES
        out += ["", f"details: {name} ({len(lines)} line{'' if len(lines) == 1 else 's'})"]
        out += [f"  {line}" for line in lines[:DETAIL_LINES]]
        if more > 0:
            out.append(f"  ... {more} more")

    t0, _ = _span(summary, events)
    faults = _faults(events)
    out += ["", f"fault timeline ({len(faults)} faults; offset from run start)"]
    out.append(f"  {'offset s':>9}  {'lane':<12} {'kind':<20} {'duration s':>10}  target")
    for fault in faults:
        out.append(
            f"  {_num(fault, 'start') - t0:>9.1f}  {_str(fault, 'lane'):<12} "
            f"{_str(fault, 'kind'):<20} {_duration(fault):>10.1f}  {_str(fault, 'target')}"
        )
    return "\n".join(out) + "\n"


# --- HTML -----------------------------------------------------------------------------------


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _table(head: Iterable[str], rows: Iterable[Iterable[object]], cls: str = "") -> str:
    attr = f' class="{_e(cls)}"' if cls else ""
    cells = "".join(f"<th>{_e(name)}</th>" for name in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{_e(value)}</td>" for value in row) + "</tr>" for row in rows
    )
    return f"<table{attr}><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


def _tick_step(seconds: float) -> float:
    """A round tick step giving at most about 12 ticks over ``seconds``."""
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200):
        if seconds / step <= 12:
            return float(step)
    return float(math.ceil(seconds / 12 / 3600) * 3600)


def _colours(names: Iterable[str], palette: tuple[str, ...]) -> dict[str, str]:
    return {name: palette[i % len(palette)] for i, name in enumerate(names)}


def _buckets(events: list[dict[str, Any]], role: str, t0: float, count: int) -> list[int]:
    """Completions of ``role`` per BUCKET_SECONDS bucket from the run's start."""
    buckets = [0] * count
    for event in _of(events, "done"):
        if _str(event, "role") == role:
            index = int((_num(event, "t") - t0) // BUCKET_SECONDS)
            buckets[min(max(index, 0), count - 1)] += int(_num(event, "n", 1.0))
    return buckets


def render_svg(summary: SoakSummary, events: list[dict[str, Any]]) -> str:
    """The run's timeline: fault lanes, throughput per role, error ticks, restarts, axis."""
    t0, seconds = _span(summary, events)
    plot = WIDTH - LEFT - RIGHT

    def x(t: float) -> float:
        return LEFT + min(max((t - t0) / seconds, 0.0), 1.0) * plot

    faults = _faults(events)
    kinds = _colours(
        sorted({_str(fault, "kind") for fault in faults} | set(summary.faults)), KIND_COLOURS
    )
    lanes = sorted({_str(fault, "lane") for fault in faults})
    roles = _roles(summary, events)
    role_colour = _colours(roles, ROLE_COLOURS)
    parts: list[str] = []
    y = 8.0

    # Legend: fault kinds, then error families.
    lx = float(LEFT)
    for label, colour, shape in [
        *((kind, colour, "rect") for kind, colour in kinds.items()),
        *((family, colour, "tick") for family, colour in FAMILY_COLOURS.items()),
        ("restart", "#555555", "dash"),
    ]:
        wide = 22 + 7 * len(label)
        if lx + wide > WIDTH - RIGHT:
            lx, y = float(LEFT), y + 18
        if shape == "rect":
            parts.append(
                f'<rect class="swatch" x="{lx:.1f}" y="{y:.1f}" width="12" height="12" '
                f'fill="{colour}"/>'
            )
        else:
            dash = ' stroke-dasharray="4 3"' if shape == "dash" else ""
            parts.append(
                f'<line class="swatch" x1="{lx + 6:.1f}" y1="{y:.1f}" x2="{lx + 6:.1f}" '
                f'y2="{y + 12:.1f}" stroke="{colour}" stroke-width="{2 if dash else 3}"{dash}/>'
            )
        parts.append(f'<text x="{lx + 16:.1f}" y="{y + 10:.1f}">{_e(label)}</text>')
        lx += wide
    y += 18 + 10
    parts.append(f'<text class="head" x="4" y="{y + 10:.1f}">faults</text>')
    y += 16
    grid_at, grid_top = len(parts), y

    # One band per fault lane, one rectangle per fault.
    for i, lane in enumerate(lanes):
        top = y + i * LANE_HEIGHT
        shade = "#f4f4f4" if i % 2 == 0 else "#fafafa"
        parts.append(
            f'<rect class="band" x="{LEFT}" y="{top:.1f}" width="{plot}" '
            f'height="{LANE_HEIGHT}" fill="{shade}" fill-opacity="0.6"/>'
        )
        parts.append(f'<text x="{LEFT - 6}" y="{top + 15:.1f}" text-anchor="end">{_e(lane)}</text>')
        for fault in faults:
            if _str(fault, "lane") != lane:
                continue
            start, end = _num(fault, "start"), _num(fault, "end")
            left = x(start)
            span = max(x(max(end, start)) - left, 1.5)
            tip = (
                f"{_str(fault, 'kind')} on {_str(fault, 'target')}: {_duration(fault):.1f} s "
                f"from +{start - t0:.1f} s"
            )
            parts.append(
                f'<rect class="fault" x="{left:.1f}" y="{top + 3:.1f}" width="{span:.1f}" '
                f'height="{LANE_HEIGHT - 6}" fill="{kinds[_str(fault, "kind")]}" '
                f'fill-opacity="0.85">'
                f"<title>{_e(tip)}</title></rect>"
            )
    y += len(lanes) * LANE_HEIGHT + GAP
    panels_top = y

    # Throughput: a band per role with its own scale, one polyline of completions per bucket.
    count = max(1, math.ceil(seconds / BUCKET_SECONDS))
    parts.append(
        f'<text class="head" x="4" y="{y - 8:.1f}">completions per {BUCKET_SECONDS:g} s</text>'
    )
    bands: dict[str, tuple[float, float]] = {}
    for role in roles:
        values = _buckets(events, role, t0, count)
        peak = max(values) or 1
        bottom = y + THROUGHPUT_HEIGHT
        bands[role] = (y, bottom)
        parts.append(
            f'<rect class="band" x="{LEFT}" y="{y:.1f}" width="{plot}" '
            f'height="{THROUGHPUT_HEIGHT}" fill="none" stroke="#e0e0e0"/>'
        )
        parts.append(
            f'<text x="{LEFT - 6}" y="{y + THROUGHPUT_HEIGHT / 2 + 4:.1f}" text-anchor="end" '
            f'fill="{role_colour[role]}">{_e(role)}</text>'
        )
        parts.append(f'<text class="scale" x="{LEFT + 4}" y="{y + 10:.1f}">max {peak}</text>')
        points = " ".join(
            f"{x(t0 + (b + 0.5) * BUCKET_SECONDS):.1f},"
            f"{bottom - 2 - value / peak * (THROUGHPUT_HEIGHT - 4):.1f}"
            for b, value in enumerate(values)
        )
        parts.append(
            f'<polyline class="throughput" fill="none" stroke="{role_colour[role]}" '
            f'stroke-width="1.2" points="{points}"><title>{_e(role)}: {sum(values)} '
            f"completions, at most {peak} per {BUCKET_SECONDS:g} s</title></polyline>"
        )
        y = bottom + 4
    y += GAP - 4

    # Error ticks: one row per role, a mark per error coloured by family.
    parts.append(f'<text class="head" x="4" y="{y - 8:.1f}">errors</text>')
    error_rows: dict[str, float] = {}
    for i, role in enumerate(roles):
        top = error_rows[role] = y + i * ERROR_ROW_HEIGHT
        parts.append(
            f'<line x1="{LEFT}" y1="{top + ERROR_ROW_HEIGHT / 2:.1f}" '
            f'x2="{WIDTH - RIGHT}" y2="{top + ERROR_ROW_HEIGHT / 2:.1f}" stroke="#eee"/>'
        )
        parts.append(f'<text x="{LEFT - 6}" y="{top + 13:.1f}" text-anchor="end">{_e(role)}</text>')
        for error in _of(events, "error"):
            if _str(error, "role") != role:
                continue
            at = x(_num(error, "t"))
            family = _str(error, "family")
            colour = FAMILY_COLOURS.get(family, OTHER_FAMILY_COLOUR)
            tip = f"{role}: {_str(error, 'type')} ({family}) at +{_num(error, 't') - t0:.1f} s"
            parts.append(
                f'<line class="error" x1="{at:.1f}" y1="{top + 3:.1f}" x2="{at:.1f}" '
                f'y2="{top + ERROR_ROW_HEIGHT - 3:.1f}" stroke="{colour}" '
                f'stroke-width="2"><title>{_e(tip)}</title></line>'
            )
    y += max(len(roles), 1) * ERROR_ROW_HEIGHT

    # Restarts: a dashed vertical line through the role's throughput band and error row.
    for restart in _of(events, "restart"):
        role = _str(restart, "role")
        at = x(_num(restart, "t"))
        tip = f"restart of {role} at +{_num(restart, 't') - t0:.1f} s: {_str(restart, 'reason')}"
        band_top, band_bottom = bands.get(role, (panels_top, panels_top))
        row = error_rows.get(role, band_bottom)
        parts.append(
            f'<path class="restart" d="M{at:.1f} {band_top:.1f}V{band_bottom:.1f}'
            f'M{at:.1f} {row:.1f}V{row + ERROR_ROW_HEIGHT:.1f}" fill="none" '
            f'stroke="{role_colour.get(role, OTHER_FAMILY_COLOUR)}" stroke-dasharray="4 3" '
            f'stroke-width="1.3"><title>{_e(tip)}</title></path>'
        )

    # Axis in seconds from the run's start.
    y += 6
    parts.append(
        f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#444"/>'
    )
    step = _tick_step(seconds)
    tick = 0.0
    grid: list[str] = []
    while tick <= seconds + 1e-9:
        at = x(t0 + tick)
        grid.append(
            f'<line class="grid" x1="{at:.1f}" y1="{grid_top:.1f}" x2="{at:.1f}" y2="{y:.1f}" '
            f'stroke="#e8e8e8"/>'
        )
        parts.append(
            f'<line x1="{at:.1f}" y1="{y:.1f}" x2="{at:.1f}" y2="{y + 5:.1f}" stroke="#444"/>'
        )
        parts.append(f'<text x="{at:.1f}" y="{y + 18:.1f}" text-anchor="middle">{tick:g}s</text>')
        tick += step
    parts[grid_at:grid_at] = grid
    height = y + 28
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {WIDTH} {height:.0f}" font-family="sans-serif" font-size="11">'
        + "".join(parts)
        + "</svg>"
    )


STYLE = """
body { font-family: sans-serif; margin: 16px; max-width: 1220px; color: #222; }
table { border-collapse: collapse; margin: 6px 0 14px; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: left; font-size: 13px; }
td.n { text-align: right; }
.fail { color: #b00; font-weight: bold; }
.okay { color: #070; font-weight: bold; }
svg text.head { font-weight: bold; }
pre { background: #f6f6f6; padding: 6px; overflow-x: auto; }
"""


def render_html(summary: SoakSummary, events: list[dict[str, Any]]) -> str:
    """One self-contained page: the summary's tables and the SVG timeline."""
    verdict = (
        '<p class="okay">OK: every anomaly is 0</p>'
        if summary.ok
        else '<p class="fail">FAILED: some anomaly is not 0</p>'
    )
    body = [f"<h1>Soak report (seed {_e(summary.seed)})</h1>", verdict]
    body.append(_table(["item", "value"], _header(summary), "summary"))
    body.append("<h2>Anomalies (each must be 0)</h2>")
    anomaly_rows = "".join(
        f'<tr class="{"okay" if count == 0 else "fail"}"><td>{_e(name)}</td>'
        f'<td class="n">{_e(count)}</td><td>must be 0</td></tr>'
        for name, count in summary.anomalies.items()
    )
    body.append(
        "<table><thead><tr><th>anomaly</th><th>count</th><th></th></tr></thead>"
        f"<tbody>{anomaly_rows}</tbody></table>"
    )
    body.append("<h2>Timeline</h2>")
    body.append(render_svg(summary, events))
    body.append("<h2>Faults by kind</h2>")
    body.append(_table(["kind", "count"], sorted(summary.faults.items())))
    body.append("<h2>Transactions, restarts per role</h2>")
    roles = _roles(summary, events)
    body.append(
        _table(
            ["role", "transactions", "restarts", "errors"],
            [
                (
                    role,
                    summary.transactions.get(role, 0),
                    summary.restarts.get(role, 0),
                    sum(summary.errors.get(role, Counter()).values()),
                )
                for role in roles
            ],
        )
    )
    body.append("<h2>Daemon passes</h2>")
    body.append(_table(["outcome", "passes"], summary.daemon_passes.items()))
    body.append("<h2>Errors by class per role</h2>")
    body.append(
        _table(
            ["role", "class", "count"],
            [
                (role, name, count)
                for role, classes in summary.errors.items()
                for name, count in classes.most_common()
            ],
        )
    )
    for name, lines in summary.details.items():
        body.append(f"<h2>Details: {_e(name)} ({len(lines)})</h2>")
        shown = lines[:HTML_DETAIL_LINES] + (
            [f"... {len(lines) - HTML_DETAIL_LINES} more"] if len(lines) > HTML_DETAIL_LINES else []
        )
        body.append("<pre>" + _e("\n".join(shown)) + "</pre>")
    t0, _ = _span(summary, events)
    body.append("<h2>Fault timeline</h2>")
    body.append(
        _table(
            ["offset s", "lane", "kind", "duration s", "target"],
            [
                (
                    f"{_num(fault, 'start') - t0:.1f}",
                    _str(fault, "lane"),
                    _str(fault, "kind"),
                    f"{_duration(fault):.1f}",
                    _str(fault, "target"),
                )
                for fault in _faults(events)
            ],
        )
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>Soak report, seed {_e(summary.seed)}</title><style>{STYLE}</style></head>"
        "<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_report(
    out_dir: Path, summary: SoakSummary, events: list[dict[str, Any]]
) -> tuple[Path, Path]:
    """Write ``report.txt`` and ``report.html`` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text, page = out_dir / "report.txt", out_dir / "report.html"
    text.write_text(render_text(summary, events), encoding="utf-8")
    page.write_text(render_html(summary, events), encoding="utf-8")
    return text, page
