"""No number a command printed goes stale silently in README.md and docs/*.md.

The convention (docs/design.md section 7, "Numbers in the docs"): every block of a page that
quotes a measured figure (a paragraph or list item, a table, a fenced output block holding a
number with a unit of time, memory, rate or loss: ``8.5 s``, ``12.6 MB``, ``48.35 GB``,
``125.1 tokens/s``, ``2.3259 nats/byte``, or a table whose header names such a unit) carries,
in the block or in the block right before it (a caption, or a comment line of its own), one of

- ``<!-- measured YYYY-MM-DD: COMMAND -->``: a dated measurement and the command that
  reproduces it (``python -m ...``, ``pytest ...``, ``scripts/...``);
- ``<!-- checked: tests/test_x.py::test_name -->``: that test compares the page's figure with
  the command's output (with its tolerance): the test exists and reads this page;
- ``<!-- not measured: REASON -->``: the numbers are arithmetic, hardware specifications or
  inputs, not a command's output.

This test fails on a block with none of them, on a marker with a malformed date or command,
and on a ``checked`` marker whose test does not exist or does not read the page.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

UNITS = r"(?:MiB|MB|GB|GiB|KiB|KB|kB|TB|ms|s|tokens/s|tok/s|steps?/s|nats/byte|nats/token|nats)"
FIGURE = re.compile(rf"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?\s?{UNITS}(?![\w/])")
"""A number with a unit: ``8.5 s``, ``48-79 s``, ``12,335.6 MiB``, ``2.3259 nats/byte``."""
SPEC = re.compile(r"(?<![\w.])(?:16|24|32|40|48|64|80|94|96|141|192) GB\b")
"""Device memory sizes (an 80 GB H100): hardware specifications, not measurements."""
HEADER_UNIT = re.compile(rf"\b{UNITS}\b|\bloss\b|step time|\bratio\b", re.I)
NUMBER_CELL = re.compile(r"\|\s*[~<>]?\s*\d[\d,]*\.\d+")
CODE_FENCES = ("python", "bash", "sh", "toml", "json", "yaml", "text-code")
MEASURED = re.compile(r"<!--\s*measured (\d{4}-\d{2}-\d{2}):\s*`?((?:\.venv/bin/)?python[3]? |pytest|scripts/|XLA_FLAGS=|JAX_)[^>]*-->")
CHECKED = re.compile(r"<!--\s*checked:\s*(tests/test_\w+\.py)::(test_\w+)\s*-->")
NOT_MEASURED = re.compile(r"<!--\s*not measured:\s*\S[^>]*-->")
ANY_MARKER = re.compile(r"<!--\s*(measured|checked|not measured)\b[^>]*-->")


def blocks(text: str) -> list[tuple[int, str, str]]:
    """``(first line number, kind, text)`` of each block: ``fence:LANG``, ``table``, ``comment``
    (an HTML comment on lines of its own) or ``para`` (consecutive non-blank lines); headings skipped."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            out.append((i + 1, "fence:" + line.strip()[3:].strip(), "\n".join(lines[i:j + 1])))
            i = j + 1
        elif line.lstrip().startswith("|"):
            j = i
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            out.append((i + 1, "table", "\n".join(lines[i:j])))
            i = j
        elif line.lstrip().startswith("<!--"):
            j = i
            while "-->" not in lines[j]:
                j += 1
            out.append((i + 1, "comment", "\n".join(lines[i:j + 1])))
            i = j + 1
        elif line.strip() and not line.startswith("#"):
            j = i
            while j < len(lines) and lines[j].strip() and not lines[j].lstrip().startswith(("```", "|", "<!--", "#")):
                j += 1
            out.append((i + 1, "para", "\n".join(lines[i:j])))
            i = j
        else:
            i += 1
    return out


def quotes_figures(kind: str, text: str) -> bool:
    """Does the block quote a measured figure (see the module docstring)?"""
    if kind.startswith("fence:") and kind[6:] in CODE_FENCES:
        return False
    prose = re.sub(r"`[^`]*`", "", text) if kind == "para" else text  # flags and code in backticks are inputs
    prose = SPEC.sub("", prose)
    if FIGURE.search(prose):
        return True
    if kind == "table":
        header = text.splitlines()[0]
        return bool(HEADER_UNIT.search(header)) and bool(NUMBER_CELL.search(text))
    return False


def problems(page: Path) -> list[str]:
    found, text = [], page.read_text()
    name = page.relative_to(ROOT).as_posix()
    bs = blocks(text)
    for k, (line, kind, body) in enumerate(bs):
        for m in ANY_MARKER.finditer(re.sub(r"`[^`\n]*`", "", body)):  # a marker quoted as code is an example
            marker = m.group(0)
            if m.group(1) == "measured":
                ok = MEASURED.fullmatch(marker)
                if not ok:
                    found.append(f"{name}:{line}: {marker!r}: write <!-- measured YYYY-MM-DD: python -m ... -->")
                    continue
                when = datetime.date.fromisoformat(ok.group(1))
                if when > datetime.date.today() + datetime.timedelta(days=1):
                    found.append(f"{name}:{line}: {marker!r}: the date lies in the future")
            elif m.group(1) == "checked":
                ok = CHECKED.fullmatch(marker)
                test = ok and ROOT / ok.group(1)
                if not ok or not test.is_file() or f"def {ok.group(2)}(" not in test.read_text():
                    found.append(f"{name}:{line}: {marker!r}: name an existing test as tests/test_x.py::test_name")
                elif name not in test.read_text():
                    found.append(f"{name}:{line}: {marker!r}: {ok.group(1)} never reads {name}")
            elif not NOT_MEASURED.fullmatch(marker):
                found.append(f"{name}:{line}: {marker!r}: write <!-- not measured: REASON -->")
        if not quotes_figures(kind, body):
            continue
        here = re.sub(r"`[^`\n]*`", "", body + ("\n" + bs[k - 1][2] if k else ""))
        if not ANY_MARKER.search(here):
            first = body.splitlines()[0][:100]
            fig = FIGURE.search(body)
            found.append(f"{name}:{line}: {first!r} quotes {fig.group(0) if fig else 'a table of figures'!r} unmarked")
    return found


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_quoted_figure_is_checked_or_dated(page):
    found = problems(page)
    assert not found, (
        f"{len(found)} block(s) quote a command's figures without a marker; put one on the line before each "
        "(<!-- measured YYYY-MM-DD: python -m ... -->, <!-- checked: tests/test_x.py::test_name -->, or "
        "<!-- not measured: why -->):\n" + "\n".join(found)
    )


def test_the_scanner_finds_unmarked_figures_and_accepts_markers():
    assert quotes_figures("para", "compiled in 48-79 s on 64 emulated devices")
    assert quotes_figures("para", "eval loss 5.8617 (step 0) -> 2.3259 nats/byte")
    assert quotes_figures("table", "| memory per device | MiB |\n|---|---:|\n| argument | 0.380 |")
    assert not quotes_figures("para", "`--steps 300` and `--seq-len 128`: see the table")
    assert not quotes_figures("para", "fits on 64 x 80 GB devices")
    assert not quotes_figures("fence:python", "x = 12.5  # MiB")
    assert [b[1] for b in blocks("<!-- measured 2026-12-05: python -m train -->\n| a MiB |\n|---|\n| 1.5 |\n")] == ["comment", "table"]
