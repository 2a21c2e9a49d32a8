"""The documents code comments cite are in the repository, and cite what is there."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for folder in ("services", "kernels", "pagedserve", "protos", "bench", "tests")
           for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".proto", ".c", ".h") and p.is_file()]
SOURCES += [ROOT / name for name in ("docker-compose.yml", "docker-compose.hostnet.yml", "Dockerfile", "README.md")]


def test_every_rule_a_comment_cites_is_in_the_architecture_document():
    rules = set(re.findall(r"^(\d+)\. \*\*", (ROOT / "docs" / "ARCHITECTURE.md").read_text(), re.M))
    assert rules == {str(n) for n in range(1, 7)}
    cited = {(path.relative_to(ROOT), n) for path in SOURCES
             for n in re.findall(r"(?:ARCHITECTURE\.md|DESIGN),? rule (\d+)", path.read_text(errors="replace"))}
    assert cited, "no comment cites a rule: the pattern is wrong"
    assert [(str(path), n) for path, n in cited if n not in rules] == []


def test_no_comment_points_outside_the_repository_for_the_design_or_the_style():
    stale = [str(path.relative_to(ROOT)) for path in SOURCES
             if re.search(r"shared/DESIGN\.md|\bSTYLE\.md", path.read_text(errors="replace"))]
    assert stale == []
    assert (ROOT / "CONTRIBUTING.md").is_file()


def test_every_test_path_the_documents_and_comments_name_exists():
    """Tests mirror the source (CONTRIBUTING.md, "Layout"): a moved test file leaves no stale path."""
    documents = SOURCES + [ROOT / name for name in ("CONTRIBUTING.md", "docs/ARCHITECTURE.md", "bench/README.md",
                                                    "bench/RESULTS.md", ".ci/run", "bench/gpu_check.sh")]
    documents += list((ROOT / "bench" / "results").glob("*.md")) + list((ROOT / "deploy").rglob("*.y*ml"))
    named = {(str(path.relative_to(ROOT)), cited) for path in documents
             for cited in re.findall(r"\btests/[\w/]+\.(?:py|c)\b", path.read_text(errors="replace"))}
    assert named, "no document names a test file: the pattern is wrong"
    assert sorted((path, cited) for path, cited in named if not (ROOT / cited).is_file()) == []


def test_the_tests_mirror_the_source():
    """Each test folder is a package's (services/<name>/) or one of the few outside services/: a test
    file is found by what it tests (CONTRIBUTING.md, "Layout"), never in a catch-all folder."""
    outside = {"engine": "services/engine.py", "pagedserve": "pagedserve/", "kernels": "kernels/", "e2e": "processes"}
    folders = {path.parent.relative_to(ROOT / "tests").parts[0] for path in (ROOT / "tests").rglob("test_*.py")
               if path.parent != ROOT / "tests"}
    assert sorted(f for f in folders if f not in outside and not (ROOT / "services" / f).is_dir()) == []


def test_the_gguf_sections_commands_parse_as_up_commands():
    """README, "Bringing a GGUF file": every command it shows is one `pagedserve up` takes (its flags exist)."""
    import argparse
    import shlex

    from services.__main__ import add_up_parser

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Bringing a GGUF file\n", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^\.venv/bin/pagedserve up (.+?)(?:\s+#.*)?$", section, re.M)
    assert len(commands) >= 2, "the section's commands were not found: the pattern is wrong"
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_up_parser(parser.add_subparsers())
    for command in commands:
        args = parser.parse_args(["up", *shlex.split(command)])
        assert args.model.endswith((".gguf", "/")), command
