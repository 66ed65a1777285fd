"""The ``dualwrite`` command as an operator runs it: a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def dualwrite_command() -> list[str]:
    """The installed ``dualwrite`` script beside this interpreter, else ``python -m``."""
    script = Path(sys.executable).parent / "dualwrite"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "dualwrite.cli"]


def dw(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``dualwrite *args`` without the DUALWRITE_* settings of this environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DUALWRITE_DB", "DUALWRITE_DATABASE_URL",
                        "DUALWRITE_BOOTSTRAP_SERVERS")}
    return subprocess.run([*dualwrite_command(), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)
