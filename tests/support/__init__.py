"""What the tests share: helper modules, fixture plugins and the worker scripts (``workers/``)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (examples/ is not a package)."""
    return script("examples", name)


def script(folder: str, name: str) -> ModuleType:
    """``<folder>/<name>.py`` of the repository as a module (``examples/``, ``spark/``: folders of
    scripts, not packages)."""
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}",
                                                  REPO_ROOT / folder / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
