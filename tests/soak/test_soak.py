"""The soak's CI form (issue 34): ``./run.sh soak`` for three minutes of mixed faults over every
role, on PostgreSQL (on MariaDB with ``--mariadb-full``); its full form (``./run.sh soak``: up to
200 faults) runs by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.soak.report import load_events
from tests.soak.schedule import LANES
from tests.support import REPO_ROOT


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("db", ["postgresql",
                                pytest.param("mariadb", marks=pytest.mark.mariadb_full)])
def test_every_role_under_mixed_faults(db: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = Path(os.environ.get("DUALWRITE_SOAK_DIR") or tmp_path) / db
    cmd = ["bash", str(REPO_ROOT / "run.sh"), "soak", "--faults", "0", "--out", str(out),
           "--db", db, "--minutes", os.environ.get("DUALWRITE_SOAK_MINUTES", "3")]
    if os.environ.get("DUALWRITE_SOAK_SEED"):
        cmd += ["--seed", os.environ["DUALWRITE_SOAK_SEED"]]
    # This interpreter's virtualenv, as it is.
    env = {**os.environ, "DUALWRITE_SKIP_INSTALL": "1",
           "DUALWRITE_VENV": str(Path(sys.executable).parent.parent)}
    run = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         timeout=1100)
    report = (out / "report.txt").read_text(encoding="utf-8") \
        if (out / "report.txt").exists() else "(no report)"
    with capsys.disabled():
        print("\n" + report)
    assert run.returncode == 0, f"exit {run.returncode}\n{report}\n{run.stderr[-6000:]}"
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["ok"] and all(n == 0 for n in summary["anomalies"].values())
    assert len(summary["anomalies"]) >= 20  # every check ran
    # Every lane injected faults; every role did work; the page was written.
    events = load_events(out / "timeline.jsonl")
    assert {e["lane"] for e in events if e["e"] == "fault"} == set(LANES)
    assert all(summary["transactions"][r] > 0 for r in ("service", "consumer", "spark",
                                                        "daemon"))
    assert "<svg" in (out / "report.html").read_text(encoding="utf-8")
    assert summary["figures"]["database"] == db
