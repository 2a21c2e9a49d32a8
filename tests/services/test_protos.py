"""The committed generated protobuf code matches protos/, and core code stays free of it."""
from __future__ import annotations

import ast
from pathlib import Path

from services.tools.proto_gen import main as proto_gen

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh():
    assert proto_gen(["--check"]) == 0, "run `python -m services.tools.proto_gen` and commit the result"


def test_core_imports_neither_grpc_nor_generated_code_nor_torch():
    for path in (ROOT / "services" / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(("grpc", "pagedserve", "torch")), f"{path.name} imports {name}"
