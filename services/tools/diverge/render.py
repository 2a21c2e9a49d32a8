"""The report for people: a table for the terminal and a self-contained HTML page (inline
style and script, nothing fetched: it opens from disk with no server and no network)."""
from __future__ import annotations

import html
import json

from services.tools.diverge.compare import DIVERGED, IDENTICAL, NOT_RUN, SAME_TOKENS, Cell
from services.tools.diverge.report import Report, VariantResult

MAX_PROMPT_COLUMNS = 16


def cell_mark(cell: Cell) -> str:
    """= identical, ≈ same tokens (other logprobs), @k diverged at token k; ~ a near-tie, ! another seed."""
    if cell.status == IDENTICAL:
        return "="
    if cell.status == SAME_TOKENS:
        return "≈"
    if cell.status == NOT_RUN:
        return "-"
    return f"@{cell.first_divergence}" + ("~" if cell.near_tie else "") + ("!" if cell.draws_same is False else "")


def describe(cell: Cell) -> str:
    if cell.status == NOT_RUN:
        return f"not run: {cell.reason}"
    parts = [cell.status]
    if cell.status == DIVERGED:
        parts.append(f"first at token {cell.first_divergence}" + (f" (sample {cell.sample_index})" if cell.sample_index else ""))
        parts.append(f"reference {cell.reference_tokens} vs {cell.variant_tokens}")
        if cell.margin is not None:
            parts.append(f"reference top-2 margin {cell.margin:.3g}" + (" (near-tie)" if cell.near_tie else ""))
    parts.append(f"max |Δ logprob| before {cell.max_logprob_delta:.3g}")
    if cell.draws_same is not None:
        parts.append("same draws (same seed)" if cell.draws_same else "other draws: the request had no seed")
    return "; ".join(parts)


def text_table(report: Report) -> str:
    ids = [c.id for c in report.cases]
    show = len(ids) <= MAX_PROMPT_COLUMNS
    rows = [["variant", "expect", "result"] + (ids if show else []) + ["note"]]
    for r in report.results:
        marks = [cell_mark(r.cells[i]) if i in r.cells else "-" for i in ids] if show else []
        note = r.note + ("" if r.exercised else " (not exercised)")
        rows.append([r.variant.name, r.variant.expect + (" *" if r.variant.name in report.fail_on else ""),
                     report.summary(r)] + marks + [note])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    legend = ("= identical (tokens and logprob bits), ≈ same tokens, other logprobs, @k first divergent token k, "
              f"~ near-tie (top-2 margin < {report.near_tie:g}), ! another seed; * counts for the exit code")
    return "\n".join([_baseline_line(report)] + lines + [legend, _verdict(report)])


def _baseline_line(report: Report) -> str:
    s = report.settings
    kernels = s.get("kernels", "") + (f" ({s['tier']})" if s.get("tier") else "")
    return (f"baseline: {report.model}, batch 1, {s.get('dtype')}, block size {s.get('block_size')}, "
            f"{s.get('num_threads')} threads, {kernels} kernels, {len(report.cases)} prompts")


def _verdict(report: Report) -> str:
    failures = report.failures()
    if not failures:
        return "OK: every variant that counts gave the baseline's tokens and logprobs, bit for bit."
    by_variant: dict[str, list[str]] = {}
    for name, case_id in failures:
        by_variant.setdefault(name, []).append(case_id)
    return "FAIL: " + "; ".join(f"{name} on {', '.join(ids)}" for name, ids in by_variant.items())


# ---- HTML -----------------------------------------------------------------------
STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px} h2{font-size:16px;margin-top:28px} code,.mono{font-family:ui-monospace,monospace}
table{border-collapse:collapse} td,th{padding:3px 6px;border:1px solid #ddd;text-align:center}
th.v{writing-mode:vertical-rl;transform:rotate(180deg);white-space:nowrap;font-weight:600}
th.fail{color:#b71c1c} td.l{text-align:left;max-width:360px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
td.c{width:34px;height:26px;font-family:ui-monospace,monospace;font-size:12px}
td.c a{color:inherit;text-decoration:none;display:block}
.identical{background:#2e7d32;color:#fff}.same{background:#aed581}.notrun{background:#eee;color:#999}
.seed{background:#9575cd;color:#fff} td.w{text-align:left}
.tie{background-image:repeating-linear-gradient(45deg,rgba(255,255,255,.55) 0 4px,transparent 4px 8px)}
.bad{outline:2px solid #b71c1c;outline-offset:-2px}
.verdict{padding:8px 12px;border-radius:4px;display:inline-block}.ok{background:#e8f5e9}.ko{background:#ffebee}
.legend span{display:inline-block;padding:2px 8px;margin-right:6px;border:1px solid #ccc}
details{margin:6px 0} summary{cursor:pointer}
"""

SCRIPT = """
document.addEventListener('DOMContentLoaded', function () {
  var cells = document.querySelectorAll('td.c');
  document.getElementById('count').textContent = cells.length + ' cells';
  document.body.setAttribute('data-rendered', 'yes');
});
"""


def _color(cell: Cell, max_tokens: int) -> str:
    """Diverged early: deep red; late: pale orange."""
    frac = min(1.0, (cell.first_divergence or 0) / max(1, max_tokens))
    return f"hsl({int(4 + 36 * frac)},{int(85 - 20 * frac)}%,{int(42 + 38 * frac)}%)"


def _td(result: VariantResult, case_id: str, max_tokens: int, failures: set[tuple[str, str]]) -> str:
    cell = result.cells.get(case_id)
    if cell is None:
        return '<td class="c notrun">-</td>'
    classes, style = ["c"], ""
    if cell.status == IDENTICAL:
        classes.append("identical")
    elif cell.status == SAME_TOKENS:
        classes.append("same")
    elif cell.status == NOT_RUN:
        classes.append("notrun")
    elif cell.draws_same is False:
        classes.append("seed")  # the request brought no seed: its draws differ, not the variant's math
    else:
        style = f' style="background-color:{_color(cell, max_tokens)};color:#fff"'
        classes += ["tie"] if cell.near_tie else []
    if (result.variant.name, case_id) in failures:
        classes.append("bad")
    title = html.escape(f"{case_id} × {result.variant.name}: {describe(cell)}")
    mark = html.escape(cell_mark(cell))
    return f'<td class="{" ".join(classes)}"{style} title="{title}"><a href="#{html.escape(case_id)}">{mark}</a></td>'


def html_page(report: Report) -> str:
    failures = set(report.failures())
    failed = {name for name, _ in failures}
    head = "".join(f'<th class="v{" fail" if r.variant.name in failed else ""}" title="{html.escape(r.variant.changes)}">'
                   f"{html.escape(r.variant.name)}</th>" for r in report.results)
    rows = []
    for case in report.cases:
        max_tokens = case.params.max_tokens
        tds = "".join(_td(r, case.id, max_tokens, failures) for r in report.results)
        rows.append(f'<tr><td class="l" title="{html.escape(case.label)}">{html.escape(case.id)}: '
                    f"{html.escape(case.label[:80])}</td>{tds}</tr>")
    verdict = _verdict(report)
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        "<title>Why did my output change? pagedserve diverge</title>",
        f"<style>{STYLE}</style><script>{SCRIPT}</script></head><body>",
        "<h1>Why did my output change?</h1>",
        f"<p>{html.escape(_baseline_line(report))}. Each column changes one variable from that baseline; "
        "each cell compares one prompt's tokens and logprobs with it.</p>",
        f'<p class="verdict {"ok" if not failed else "ko"}">{html.escape(verdict)}</p>',
        '<p class="legend"><span class="identical">= identical</span><span class="same">≈ same tokens</span>'
        '<span style="background:hsl(4,85%,42%);color:#fff">@k diverged at token k (early: red)</span>'
        f'<span class="tie" style="background-color:#e57373">~ near-tie (margin &lt; {report.near_tie:g})</span>'
        '<span class="seed">! another seed (the request had none)</span><span class="bad">failed a promise</span> <span id="count"></span></p>',
        f"<h2>First divergence, prompts × variants</h2><table><tr><th>prompt</th>{head}</tr>{''.join(rows)}</table>",
        _variants_table(report),
        "<h2>Prompts</h2>", *(_prompt_section(report, case) for case in report.cases),
        f'<h2>Raw data</h2><details><summary>JSON</summary><pre class="mono">'
        f"{html.escape(json.dumps(report.to_json(), indent=1)[:200000])}</pre></details>",
        "</body></html>",
    ]
    return "\n".join(parts)


def _variants_table(report: Report) -> str:
    rows = "".join(
        f"<tr><td class=w>{html.escape(r.variant.name)}</td><td class=w>{html.escape(r.variant.changes)}</td>"
        f"<td>{html.escape(r.variant.expect)}{' (counts)' if r.variant.name in report.fail_on else ''}</td>"
        f"<td class=w>{html.escape(report.summary(r))}</td>"
        f"<td class=w>{html.escape(r.note + ('' if r.exercised else ' (not exercised)'))}</td>"
        f"<td>{r.seconds:.1f}s</td></tr>" for r in report.results)
    return ("<h2>Variants</h2><table><tr><th>variant</th><th>what changes</th><th>expected</th><th>result</th>"
            f"<th>note</th><th>time</th></tr>{rows}</table>")


def _prompt_section(report: Report, case) -> str:
    baseline = report.baseline.get(case.id, [])
    text = baseline[0].text if baseline else ""
    items = []
    for r in report.results:
        cell = r.cells.get(case.id)
        if cell is not None and cell.status != IDENTICAL:
            items.append(f"<li><b>{html.escape(r.variant.name)}</b>: {html.escape(describe(cell))}</li>")
    return (f'<details id="{html.escape(case.id)}"><summary><b>{html.escape(case.id)}</b>: '
            f"{html.escape(case.label[:200])}</summary><p>baseline output: <span class=mono>{html.escape(text)}</span>"
            f"</p><p>token ids: <span class=mono>{html.escape(str(baseline[0].token_ids if baseline else []))}</span></p>"
            f"<ul>{''.join(items) or '<li>identical under every variant</li>'}</ul></details>")
