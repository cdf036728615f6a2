"""Every markdown link in docs/ and the README resolves, and the two front pages stay short.

A link is ``[text](target)`` outside code (fenced blocks and inline code spans are
skipped); web addresses (``http:``, ``https:``, ``mailto:``) are not followed. A relative
target must name a file or folder of the repository; a ``#anchor`` must be the slug of a
heading in the target (the page itself when the target is only ``#anchor``), made as
GitHub makes it: lowercased, every character but letters, digits, ``_``, ``-`` and spaces
dropped, spaces turned into ``-``, and a repeated slug suffixed ``-1``, ``-2`` ... in
order. Headings inside code blocks are not headings. A failure names every broken link
with its file and line.

The front pages are an overview and a door: ``docs/architecture.md`` at most
``ARCHITECTURE_MAX_LINES`` lines, ``README.md`` at most ``README_MAX_LINES``; the detail
belongs in the topic pages under docs/.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE_MAX_LINES = 520
README_MAX_LINES = 160

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or [text](target "title"); text may hold one level of brackets.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")


def pages() -> list[Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every line outside fenced code blocks."""
    out, fenced = [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fenced is None:
                fenced = match.group(1)
            elif match.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text (before the suffix for repeats)."""
    text = re.sub(r"<[^>]+>", "", heading)                 # inline HTML
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def paragraphs(path: Path) -> list[list[tuple[int, str]]]:
    """Runs of consecutive prose lines: a link's text may wrap onto the next line."""
    runs: list[list[tuple[int, str]]] = []
    last = None
    for number, line in prose_lines(path):
        if not line.strip():
            last = None
            continue
        if last is None or number != last + 1:
            runs.append([])
        runs[-1].append((number, line))
        last = number
    return runs


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link, the line being where the link starts."""
    out = []
    for run in paragraphs(path):
        text, starts = "", []
        for number, line in run:
            starts.append((len(text), number))
            text += line + "\n"
        text = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), text)
        for match in LINK.finditer(text):
            number = max(n for offset, n in starts if offset <= match.start())
            out.append((number, match.group(1)))
    return out


def problem(page: Path, target: str) -> str | None:
    """Why ``target``, linked from ``page``, does not resolve; None when it does."""
    if not target or target.startswith(EXTERNAL):
        return None
    file_part, _, anchor = target.partition("#")
    resolved = (page.parent / file_part).resolve() if file_part else page
    if not resolved.exists():
        return f"no file {file_part}"
    if not resolved.is_relative_to(ROOT):
        return f"{file_part} is outside the repository"
    if anchor:
        if resolved.suffix != ".md":
            return f"#{anchor} into {file_part}, which is not a markdown page"
        if anchor not in anchors(resolved):
            return f"no heading with the anchor #{anchor} in {resolved.relative_to(ROOT)}"
    return None


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Gang admission (`services/admission/`)") == "gang-admission-servicesadmission"
    assert slug("`phalanx job JOB [--json]`") == "phalanx-job-job---json"
    assert slug("What's new? A & B") == "whats-new-a--b"
    assert slug("Über_größe 2") == "über_größe-2"


def test_repeated_headings_get_numbered_anchors(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# A\n## Limits\n```\n## Limits\n```\n### Limits\n")
    assert anchors(page) == {"a", "limits", "limits-1"}


def test_links_may_wrap_and_code_is_no_link(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("x [a\nb](c.md#d) `[e](f)`\n\n```\n[g](h)\n```\n[i](j)\n")
    assert links(page) == [(1, "c.md#d"), (7, "j")]


def test_every_link_in_the_docs_and_the_readme_resolves() -> None:
    assert len(pages()) > 5
    broken = [f"{page.relative_to(ROOT)}:{number}: ({target}): {why}"
              for page in pages() for number, target in links(page)
              if (why := problem(page, target))]
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize(("name", "most"), [("docs/architecture.md", ARCHITECTURE_MAX_LINES),
                                            ("README.md", README_MAX_LINES)])
def test_the_front_pages_stay_short(name: str, most: int) -> None:
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= most, f"{name} has {lines} lines, at most {most}: move detail to docs/"
