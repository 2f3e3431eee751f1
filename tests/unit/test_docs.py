"""The documentation holds together: README.md stays a page a newcomer reads in ten minutes (at most 250 lines),
every relative Markdown link in README.md, posttrain/README.md and docs/ points at a file (and heading) inside the
repository, and every results page in docs/results/ names its date, a commit and the machine it was measured on."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_README_LINES = 250
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
# a commit: 7 to 40 hex digits with a letter among them, or any such run on a "Commit:" line (1303534 is one)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
                    r"|^(?:- )?Commits?:.*?\b[0-9a-f]{7,40}\b", re.MULTILINE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"^(?:- )?Machine:\s*\S", re.MULTILINE)


def doc_pages() -> list[Path]:
    return [REPO / "README.md", REPO / "posttrain" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def results_pages() -> list[Path]:
    return [p for p in sorted((REPO / "docs" / "results").glob("*.md")) if p.name != "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def relative_links(page: Path) -> list[str]:
    targets = LINK.findall(FENCE.sub("", page.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not files


def test_readme_is_at_most_250_lines():
    lines = (REPO / "README.md").read_text().count("\n")
    assert 0 < lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"


def test_every_relative_link_points_at_a_file_in_the_repository():
    pages = doc_pages()
    assert len(pages) > 10  # the walk found docs/
    broken = []
    for page in pages:
        for target in relative_links(page):
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(REPO)} -> {target}"
            if not resolved.is_relative_to(REPO):
                broken.append(f"{where} (outside the repository)")
            elif not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_results_page_names_its_date_commit_and_machine():
    pages = results_pages()
    assert len(pages) >= 5  # the results moved out of the README are there
    missing = {}
    for page in pages:
        text = page.read_text()
        lacks = [what for what, pattern in (("a date", DATE), ("a commit", COMMIT), ("a 'Machine:' line", MACHINE))
                 if not pattern.search(text)]
        if lacks:
            missing[page.name] = lacks
    assert not missing, f"results pages without their provenance: {missing}"


def test_the_results_index_lists_every_results_page():
    index = (REPO / "docs" / "results" / "README.md").read_text()
    unlisted = [p.name for p in results_pages() if f"]({p.name})" not in index]
    assert not unlisted, f"docs/results/README.md does not list: {unlisted}"


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The patterns above fail where they should: a bare number is no commit, a missing file is a broken link."""
    assert not COMMIT.search("measured 1234567 times on 2026-12-01")
    assert COMMIT.search("at commit 96f1956")
    assert COMMIT.search("- Commit: 1303534 (a fresh clone)")
    assert not MACHINE.search("the machine was busy")
    page = tmp_path / "page.md"
    page.write_text("See [a](missing.md), [b](https://example.org), [c](#here).\n\n## Here\n\n```\n[d](nowhere.md)\n```\n")
    assert relative_links(page) == ["missing.md", "#here"]
    assert anchors(page) == {"here"}
    assert slug("Instruction constraints (IFEval-style) and `pipeline=smollm2-ifeval`") == (
        "instruction-constraints-ifeval-style-and-pipelinesmollm2-ifeval")
