"""The package layout's rules (docs/architecture.md), checked on the source so they cannot erode:
arrows that point one way, no module reading another's underscore names, a small top-level API."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import dualwrite

pytestmark = pytest.mark.unit

PACKAGE = Path(dualwrite.__file__).resolve().parent

# What each part of the library may import from dualwrite (besides itself and ``errors``).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "deadline": set(),
    "metrics": set(),
    "participant": set(),
    "database": set(),
    "writer": {"participant", "database", "metrics"},
    "batch": {"participant", "database", "metrics"},
    "consumer": {"participant", "database", "writer", "metrics"},
    "recovery": {"participant", "database", "writer", "batch", "consumer", "metrics"},
    "spark": {"participant", "database", "batch", "metrics"},
    "cli": {"participant", "database", "batch", "recovery", "dev", "consumer", "metrics"},
    "dev": {"participant"},  # dev.read_committed: the test form of the topic reader
    "pulsar": {"participant", "writer", "recovery"},  # the Pulsar names, one import away
}


# Documented, public functions whose names start with an underscore: ``os._exit`` (the recovery
# daemon leaves without joining a pass it abandons).
PUBLIC_UNDERSCORED = {"_exit": ("os",)}


def _modules() -> list[Path]:
    """The package's modules, without protoc's generated ones (they use protobuf's internals)."""
    return sorted(p for p in PACKAGE.rglob("*.py") if not p.name.endswith("_pb2.py"))


def _part(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else ""


def _dualwrite_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dualwrite"):
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names
                      if a.name.startswith("dualwrite")]
    return found


def test_arrows_point_one_way() -> None:
    wrong = []
    for path in _modules():
        part = _part(path)
        if not part:  # dualwrite/__init__.py re-exports from everywhere
            continue
        for line, module, _ in _dualwrite_imports(path):
            target = module.split(".")[1] if "." in module else ""
            if target in ("", part, "errors", "deadline"):  # importable from every part
                continue
            if target not in ALLOWED[part]:
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert wrong == []


def test_no_module_uses_another_modules_underscore_names() -> None:
    """``x._name`` only on ``self``/``cls``; underscore modules and names imported only from
    within their own package."""
    wrong = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls", *PUBLIC_UNDERSCORED.get(node.attr, ()))
            if (isinstance(node, ast.Attribute) and node.attr[:1] == "_"
                    and node.attr[1:2].islower() and not own):
                wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
        package = ".".join(("dualwrite", *path.relative_to(PACKAGE).parts[:-1]))
        for line, module, names in _dualwrite_imports(path):
            parts = module.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_")]
            if private and ".".join(parts[:private[0]]) != package:
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
            wrong += [f"{path.relative_to(PACKAGE)}:{line} imports {module}.{n}"
                      for n in names if n.startswith("_") and not n.startswith("__")]
    assert wrong == []


def test_the_top_level_exports_the_application_and_operator_api_only() -> None:
    exported = set(dualwrite.__all__)
    for internal in ("ControlPlane", "StateStore", "StateRow", "Completion", "TxnState",
                     "TopicPartition", "TransactionDescription", "ProbeResult"):
        assert internal not in exported
    for received in ("BatchHeuristicAbortError", "KafkaErrorInfo", "RecoveryResult",
                     "SinkStatus", "Outcome", "DualWriter", "DualWriterPool", "GroupedTransaction",
                     "AsyncDualWriterPool", "AsyncTransaction", "recover", "status",
                     "ExactlyOnceConsumer", "ConsumedMessage", "PartitionFencedError",
                     "open_transactions", "OpenTransaction",
                     "AuthorizationError", "UnknownTopicError", "RecordTooLargeError",
                     "InvalidRecordError", "ConfigurationError"):
        assert received in exported
    assert all(hasattr(dualwrite, name) for name in exported)


@pytest.mark.parametrize("name", ["participant", "writer", "consumer", "batch", "recovery",
                                  "database", "spark", "dev"])
def test_each_subpackage_declares_its_surface(name: str) -> None:
    module = importlib.import_module(f"dualwrite.{name}")
    assert module.__all__ and all(hasattr(module, n) for n in module.__all__)
