"""Generate the Python protobuf/gRPC modules from protos/ into the `pagedserve` package.

    python -m services.tools.proto_gen          # regenerate
    python -m services.tools.proto_gen --check  # exit 1 when the committed code is stale

The -I root is protos/, so generated modules import each other as
`from pagedserve.internal.v1 import common_pb2`, which resolves inside the package.
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: protos/ and pagedserve/ are beside services/
PROTOS = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    files = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    code = protoc.main(["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
                        f"--grpc_python_out={out}", *files])
    if code != 0:
        raise SystemExit(f"protoc failed with {code}")
    for proto in files:  # every folder on the way down is a package
        for package in Path(proto).parents[:-1]:
            init = out / package / "__init__.py"
            if not init.exists():
                init.write_text("")
    return [path.relative_to(out) for path in sorted(out.rglob("*"))
            if path.is_file() and path.suffix in (".py", ".pyi")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed code is stale")
    args = parser.parse_args(argv)
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        # A package's __init__.py only has to exist: pagedserve/__init__.py is the public API's.
        stale = [str(p) for p in fresh if not (ROOT / p).is_file() or (
            p.name != "__init__.py" and not filecmp.cmp(Path(tmp) / p, ROOT / p, shallow=False))]
    if stale:
        print("stale generated code, run `python -m services.tools.proto_gen`:", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
