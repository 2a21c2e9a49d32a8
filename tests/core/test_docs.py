"""The documents code comments cite are in the repository, and cite what is there."""
from __future__ import annotations

import re
import textwrap
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
    documents += list((ROOT / "bench" / "results").glob("*.md")) + list((ROOT / "deploy").rglob("*.y*ml")) + GUIDE
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


GUIDE = sorted((ROOT / "docs" / "guide").glob("*.md"))
USER_DOCUMENTS = [ROOT / "README.md", *GUIDE]  # what a user reads: every example in them is checked here
SETUP_AND_SERVE = "./setup.sh && .venv/bin/pagedserve up"
TEST_COMMAND = ".venv/bin/python -m pytest -q"


def _blocks(path: Path, language: str) -> list[str]:
    return [textwrap.dedent(block) for block in
            re.findall(rf"^ *```{language}\n(.*?)^ *```", path.read_text(), re.M | re.S)]


def _command_lines(path: Path) -> list[str]:
    """The command lines of a document's bash blocks, continuation lines joined, comments dropped."""
    lines = []
    for block in _blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.sub(r"\s+#.*$", "", line).split("&&"):
                if part.strip() and not part.strip().startswith("#"):
                    lines.append(part.strip())
    return lines


def test_the_readme_starts_with_the_two_commands_and_stays_short():
    """Set up and serve, then run the tests: the first two commands a newcomer sees, and the test command
    the one .ci/run runs on a clean clone."""
    readme = ROOT / "README.md"
    first, second = [block.strip() for block in _blocks(readme, "bash")[:2]]
    assert first.split("  #")[0].strip() == SETUP_AND_SERVE
    assert second == f"./setup.sh && {TEST_COMMAND}"
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()
    assert len(readme.read_text().splitlines()) < 250, "the README is what a newcomer reads in five minutes"


def _parsers():
    import argparse

    from services.__main__ import add_up_parser
    from services.tools.diverge.cli import add_diverge_parser

    main = argparse.ArgumentParser(prog="pagedserve")
    commands = main.add_subparsers()
    add_up_parser(commands)
    add_diverge_parser(commands)
    services = {}
    for name in ("scheduler", "worker", "frontend"):
        module = __import__(f"services.{name}.__main__", fromlist=["parse_args"])
        services[name] = module.parse_args
    return main.parse_args, services


COMMAND = re.compile(r"^(?:\S*=\S* )*(?:\.venv/bin/)?(?:pagedserve (?P<sub>up|diverge)|python -m services (?P<sub2>up|diverge)"
                     r"|python -m services\.(?P<service>scheduler|worker|frontend))(?P<args>(?: .*)?)$")


def test_every_pagedserve_command_the_documents_show_parses():
    """Each `pagedserve up|diverge` and `python -m services[.scheduler|.worker|.frontend]` line in the README
    and the guide takes only flags its command has (a renamed flag leaves no stale example)."""
    import shlex

    parse_main, services = _parsers()
    checked, failed = 0, []
    for path in USER_DOCUMENTS:
        for line in _command_lines(path):
            match = COMMAND.match(line.removeprefix(".venv/bin/").replace(".venv/bin/python", "python"))
            if match is None:
                continue
            args = shlex.split(match["args"])
            try:
                if match["service"]:
                    services[match["service"]](args)
                else:
                    parse_main([match["sub"] or match["sub2"], *args])
            except SystemExit:
                failed.append((str(path.relative_to(ROOT)), line))
            checked += 1
    assert checked >= 10, "the commands were not found: the pattern is wrong"
    assert failed == []


def test_every_python_example_in_the_documents_compiles():
    import ast

    blocks = [(path, block) for path in USER_DOCUMENTS for block in _blocks(path, "python")]
    assert len(blocks) >= 15, "the examples were not found: the pattern is wrong"
    failed = []
    for path, block in blocks:
        try:
            ast.parse(block)
        except SyntaxError as error:
            failed.append((str(path.relative_to(ROOT)), str(error), block[:80]))
    assert failed == []


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S), re.M)}


def test_every_link_in_the_documents_leads_somewhere():
    """Relative links of the README and the guide name a file that exists, and a heading that exists in it."""
    broken, checked = [], 0
    for path in USER_DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"<!--.*?-->", "", path.read_text(), flags=re.S)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            checked += 1
            if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved)):
                broken.append((str(path.relative_to(ROOT)), target))
    assert checked >= 30, "no link found: the pattern is wrong"
    assert broken == []


def test_the_guide_index_and_the_readme_link_every_guide_page():
    index = (ROOT / "docs" / "guide" / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    pages = [path.name for path in GUIDE if path.name != "README.md"]
    assert len(pages) >= 10
    assert [page for page in pages if f"]({page}" not in index] == []
    assert [page for page in pages if f"](docs/guide/{page}" not in readme] == []


def test_every_section_a_comment_cites_exists():
    """`docs/guide/models.md, "Int8 activations"`-style citations in code and documents name a real heading."""
    documents = SOURCES + [ROOT / name for name in ("CONTRIBUTING.md", "docs/ARCHITECTURE.md", "bench/README.md")]
    documents += USER_DOCUMENTS + list((ROOT / "deploy").rglob("*.y*ml"))
    cited = {(str(path.relative_to(ROOT)), doc, section) for path in documents
             for doc, section in re.findall(r"\b(docs/guide/[\w-]+\.md|README(?:\.md)?),? [\"']([^\"'\n]+)[\"']",
                                            path.read_text(errors="replace"))}
    assert len(cited) >= 5, "no citation found: the pattern is wrong"
    headings = {}
    for _, doc, _ in cited:
        file = ROOT / ("README.md" if doc.startswith("README") else doc)
        headings[doc] = set(re.findall(r"^#+ (.+?)\s*$", file.read_text(), re.M)) if file.is_file() else set()
    assert sorted((path, doc, section) for path, doc, section in cited if section not in headings[doc]) == []


# a figure: a number with its unit or a ratio ("83.5 tok/s", "10.55x", "66.6%", "12.6 ms"), a commit hash, a date
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:x|tok/s|ms|%|GB/s|MB/s)(?!\w)")
STAMP = re.compile(r"\b(?:20\d\d-\d\d-\d\d|[0-9a-f]{7,40})\b")


def test_the_readme_carries_no_figures_only_links_to_them():
    """Figures live in bench/RESULTS.md ("Current figures", each with its date, commit, CPU and load); a
    README that copied them drifted from it. Link to the row instead."""
    readme = (ROOT / "README.md").read_text()
    prose = re.sub(r"^```.*?^```", "", readme, flags=re.M | re.S)
    assert [line for line in prose.splitlines() if FIGURE.search(line) or STAMP.search(line)] == []
    assert "bench/RESULTS.md" in readme


def test_the_gguf_guides_commands_name_a_gguf_file():
    """docs/guide/gguf.md: every `pagedserve up` command it shows, its architectures' table's included, is one
    `up` takes and names a GGUF file or a folder (or none: the default model, a GGUF file itself)."""
    import argparse
    import shlex

    from services.__main__ import add_up_parser

    guide = (ROOT / "docs" / "guide" / "gguf.md").read_text()
    commands = re.findall(r"^\.venv/bin/pagedserve up(.*?)(?:\s+#.*)?$", guide, re.M)
    commands += re.findall(r"`pagedserve up (--model [^`]+)`", guide)  # the architectures' table
    assert len(commands) >= 12, "the guide's commands were not found: the pattern is wrong"
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_up_parser(parser.add_subparsers())
    for command in commands:
        args = parser.parse_args(["up", *shlex.split(command)])
        assert args.model.endswith((".gguf", "/")) or (args.model == "default" and not command), command


def test_the_benchmark_documents_name_no_path_of_the_machine_they_ran_on():
    """A figure's command names the peers' folders by placeholders (LLAMA_CPP_BIN, ...: bench/README.md)."""
    found = [(name, path) for name in ("bench/RESULTS.md", "bench/README.md")
             for path in re.findall(r"(?<![\w.~])/(?:work|tmp|home|root)/\S*", (ROOT / name).read_text())]
    assert found == []
    # each results file records its command: the peers' and checkouts' folders there too (an output under
    # /tmp names no folder of the machine's)
    results = [file for file in sorted((ROOT / "bench" / "results").iterdir()) if file.suffix in (".md", ".json")]
    found = [(file.name, path) for file in results
             for path in re.findall(r"(?<![\w.~])/(?:work|home|root)/\S*", file.read_text())]
    assert found == []


def test_each_current_figure_says_when_where_and_under_what_load():
    """bench/RESULTS.md, "Current figures": one figure a row, with its date, commit, CPU and load."""
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    table = results.split("## Current figures\n", 1)[1].split("\n#", 1)[0]
    header, _, *rows = [line for line in table.splitlines() if line.startswith("|")]
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    assert columns == ["claim", "cell", "figure", "target", "command", "date (UTC)", "commit", "CPU, tier, threads", "load"]
    measured = [dict(zip(columns, (cell.strip() for cell in row.strip().strip("|").split("|")))) for row in rows]
    assert {len(row.strip().strip("|").split("|")) for row in rows} == {len(columns)}
    measured = [row for row in measured if row["figure"] != "not yet measured"]
    assert len(measured) >= 40
    bad = [row["claim"][:60] + " / " + row["cell"] for row in measured
           if not re.fullmatch(r"20\d\d-\d\d-\d\d \d\d:\d\d", row["date (UTC)"])
           or not re.match(r"[0-9a-f]{7}\b", row["commit"])
           or not re.match(r"(Zen 3|Zen 4|Zen 5|EPYC|Intel)\b", row["CPU, tier, threads"])
           or not re.fullmatch(r"[\d.]+(?:-[\d.]+)?", row["load"])
           or row["figure"].count("**") != 2]
    assert bad == []


def test_the_gguf_guide_lists_what_is_served():
    """docs/guide/gguf.md's tables name every block type (kernels/quant.py FORMATS) and every architecture
    (services/worker/gguf_arch.py SERVED: the decoders' ARCHITECTURES and the encoders) the engine serves, and no
    other."""
    from kernels import quant
    from services.worker.gguf_arch import SERVED

    guide = (ROOT / "docs" / "guide" / "gguf.md").read_text()
    types = guide.split("\n## Types\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| (\w+) \| (?:32|256) \|", types, re.M))
    assert listed == {quant.NAMES[f].upper() for f in quant.GGUF_FORMATS}
    archs = guide.split("\n## Architectures\n", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"^\| `([\w-]+)` \|", archs, re.M)) == set(SERVED)
