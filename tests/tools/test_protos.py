"""The committed generated protobuf code matches protos/, and core code stays free of it."""
from __future__ import annotations

import ast
from pathlib import Path

from services.tools.proto_gen import main as proto_gen

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh():
    assert proto_gen(["--check"]) == 0, "run `python -m services.tools.proto_gen` and commit the result"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update([node.module or ""] + [f"{node.module}.{a.name}" for a in node.names])
    return names


def test_core_imports_neither_grpc_nor_generated_code_nor_torch():
    for path in (ROOT / "services" / "core").rglob("*.py"):
        for name in imported_modules(path):
            assert not name.startswith(("grpc", "pagedserve", "torch")), f"{path.name} imports {name}"


# The gRPC edge: the only modules that import the generated code (services/rpc/internal_codec.py).
EDGE = ("servicer.py", "server.py", "_client.py", "registrar.py", "_codec.py")


def test_only_the_grpc_edge_imports_generated_code():
    """The codecs, the servicers, the servers that register them and the clients; the tools
    (which talk to a deployment as a client does) and the public Python client too."""
    generated = ("pagedserve.v1", "pagedserve.internal")
    found = []
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "pagedserve").glob("*.py")]:
        relative = path.relative_to(ROOT)
        if path.name.endswith(EDGE) or relative.parts[:2] == ("services", "tools") or \
                relative == Path("pagedserve/client.py"):
            continue
        found += [f"{relative} imports {name}" for name in imported_modules(path) if name.startswith(generated)]
    assert found == []
