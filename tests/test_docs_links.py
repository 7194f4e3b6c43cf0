"""Relative links in README.md, docs/ and the drafter cards point at files that exist, and their #anchors at
headings that exist (GitHub's heading slugs). External links (http, mailto) are not followed: no network in tests."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "drafters").glob("*/README.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # link-like text inside code spans is code, not a link
    return [a or b for a, b in LINK.findall(text)]


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or #anchor does not exist, each with the reason."""
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.name})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.name})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(REPO)}: broken links: " + "; ".join(broken)


def test_checker_finds_broken_links(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section (2026)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section-2026) [gone](missing.md) [bad anchor](other.md#nope) [self](#top)\n"
                    "`[code](not-a-link.md)` [web](https://example.com/x)\n\n# Top\n")
    found = broken_links(page)
    assert len(found) == 2 and found[0].startswith("missing.md") and found[1].startswith("other.md#nope")


def test_slug_rules():
    assert github_slug("Draft length by confidence (2026-12-06)") == "draft-length-by-confidence-2026-12-06"
    assert github_slug("The `engines/` directory, 3.") == "the-engines-directory-3"
    assert github_slug("What holds now: one figure") == "what-holds-now-one-figure"
