"""What the tests share: helper modules, fixture plugins and the worker scripts (``workers/``)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
