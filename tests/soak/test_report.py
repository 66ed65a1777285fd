"""The soak report from synthetic events: the text carries the counts and anomaly lines, the
HTML parses with balanced tags, one rectangle per fault and one line per role, escapes what it
shows, and a JSON-lines file cut short in its last line still loads."""

from __future__ import annotations

import json
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from tests.soak.report import SoakSummary, load_events, render_html, render_text, write_report

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0
VOID = {"meta", "br", "hr", "img", "input", "link", "col", "area", "base", "wbr"}


def _events() -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"e": "fault", "kind": "broker_kill", "lane": "kafka", "start": T0 + 10,
         "end": T0 + 25, "target": "broker-2"},
        {"e": "fault", "kind": "pg_restart", "lane": "postgres", "start": T0 + 30,
         "end": T0 + 34.5, "target": "<script>alert(1)</script>"},
        {"e": "fault", "kind": "network_delay", "lane": "kafka", "start": T0 + 50,
         "end": T0 + 58, "target": "broker-1"},
        {"e": "error", "role": "service", "t": T0 + 12, "type": "OutcomeUnknownError",
         "family": "retriable"},
        {"e": "error", "role": "consumer", "t": T0 + 31, "type": "FencedError",
         "family": "fatal"},
        {"e": "restart", "role": "consumer", "t": T0 + 32, "reason": "fenced"},
        {"e": "scrape", "t": T0 + 60, "ok": 12, "error": 1},
    ]  # fmt: skip
    for second in range(0, 90, 2):
        events.append({"e": "done", "role": "service", "t": T0 + second, "n": 3})
        events.append({"e": "done", "role": "consumer", "t": T0 + second + 1, "n": 1})
    return events


def _summary(**anomalies: int) -> SoakSummary:
    return SoakSummary(
        seed=4242,
        seconds=90.0,
        minutes_planned=1.5,
        faults=Counter({"broker_kill": 1, "pg_restart": 1, "network_delay": 1}),
        transactions={"service": 135, "consumer": 45},
        errors={
            "service": Counter({"OutcomeUnknownError (retriable)": 7}),
            "consumer": Counter({"FencedError (fatal)": 1}),
        },
        restarts={"consumer": 1},
        daemon_passes={"ok": 40, "error": 3},
        anomalies={"duplicates": 0, "lost": 0, **anomalies},
        details={"lost": [f"key-{i}" for i in range(20)]},
        figures={"kafka": "3.9.1"},
    )


class _Tags(HTMLParser):
    """Every start tag with its attributes, and whether the non-void tags balance."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[tuple[str, dict[str, str | None]]] = []
        self.stack: list[str] = []
        self.unbalanced: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.starts.append((tag, dict(attrs)))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.starts.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack.pop() != tag:
            self.unbalanced.append(tag)

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def count(self, tag: str, cls: str | None = None) -> int:
        return sum(
            1
            for name, attrs in self.starts
            if name == tag and (cls is None or attrs.get("class") == cls)
        )


def _parse(page: str) -> _Tags:
    parser = _Tags()
    parser.feed(page)
    parser.close()
    assert parser.unbalanced == [] and parser.stack == []
    return parser


def test_text_has_counts_anomalies_details_and_timeline() -> None:
    text = render_text(_summary(), _events())
    assert "seed           4242" in text
    assert "faults         3 (broker_kill 1, network_delay 1, pg_restart 1)" in text
    assert "service 135, consumer 45" in text
    assert "daemon passes  ok 40, error 3" in text
    assert "7  OutcomeUnknownError (retriable)" in text
    assert "duplicates: 0 (must be 0)" in text and "lost: 0 (must be 0)" in text
    assert "key-11" in text and "key-12" not in text and "... 8 more" in text
    timeline = text.split("fault timeline")[1].splitlines()[2:]
    assert [line.split()[:3] for line in timeline] == [
        ["10.0", "kafka", "broker_kill"],
        ["30.0", "postgres", "pg_restart"],
        ["50.0", "kafka", "network_delay"],
    ]
    assert timeline[1].split()[3] == "4.5"
    assert text.startswith("soak report") and "result         OK" in text


def test_ok_false_when_an_anomaly_is_not_zero() -> None:
    assert _summary().ok
    bad = _summary(lost=2)
    assert not bad.ok
    text = render_text(bad, _events())
    assert "FAIL  lost: 2 (must be 0)" in text and "FAILED (1 anomaly)" in text
    assert "FAILED" in render_html(bad, _events())


def test_html_parses_with_a_rect_per_fault_and_a_line_per_role() -> None:
    page = render_html(_summary(), _events())
    tags = _parse(page)
    assert tags.count("svg") == 1 and "</svg>" in page
    assert tags.count("rect", "fault") == 3
    assert tags.count("polyline", "throughput") == 2
    assert tags.count("line", "error") == 2
    assert tags.count("path", "restart") == 1
    assert tags.count("script") == 0
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<script>" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )
    # Throughput per 5 s bucket: the service completes 3 every 2 s, 7 or 8 per bucket.
    service = next(
        attrs["points"]
        for name, attrs in tags.starts
        if name == "polyline" and attrs.get("stroke") == "#1f77b4"
    )
    assert service is not None and len(service.split()) == 18
    assert "must be 0" in "".join(tags.text)


def test_empty_run_still_renders() -> None:
    summary = SoakSummary(seed=1, seconds=0.0, minutes_planned=0.0)
    assert "(none)" in render_text(summary, [])
    _parse(render_html(summary, []))


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    lines = [json.dumps(event) for event in _events()]
    path.write_text("\n".join(lines) + "\n" + lines[0][:17], encoding="utf-8")
    assert load_events(path) == _events()
    path.write_text(lines[0][:17] + "\n" + "\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=":1: not a JSON line"):
        load_events(path)


def test_write_report_writes_both_files(tmp_path: Path) -> None:
    text, page = write_report(tmp_path / "out", _summary(), _events())
    assert text.name == "report.txt" and page.name == "report.html"
    assert "must be 0" in text.read_text(encoding="utf-8")
    _parse(page.read_text(encoding="utf-8"))
