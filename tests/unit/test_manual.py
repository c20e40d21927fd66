"""The manual holds together: every relative link in the README and ``docs/`` reaches a file (and
a heading, for ``#anchors``), the README stays a front door, and the docs state facts, not the
numbers of the issues that asked for them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"```.*?```", re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _links(page: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_target(page: Path) -> None:
    for link in _links(page):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.relative_to(ROOT)}: link {link!r} reaches nothing"
        assert ROOT in path.parents or path == ROOT, f"{page.relative_to(ROOT)}: {link!r} leaves the repository"
        if anchor:
            assert path.suffix == ".md", f"{page.relative_to(ROOT)}: {link!r}: an anchor into a non-markdown file"
            assert anchor in _anchors(path), f"{page.relative_to(ROOT)}: {link!r}: no heading {anchor!r} in {target}"


def test_the_slug_is_githubs() -> None:
    assert _slug("The layout for beams on short prompts") == "the-layout-for-beams-on-short-prompts"
    assert _slug("The `hf-vkv` command") == "the-hf-vkv-command"
    assert _slug("Options: `cache_config`") == "options-cache_config"
    assert _slug("Decode step against the ideal cache (the CPU default, head-major)") == \
        "decode-step-against-the-ideal-cache-the-cpu-default-head-major"


def test_a_broken_link_is_seen(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) and [b](https://example.org) ```[c](in-code.md)```\n")
    assert _links(page) == ["missing.md", "https://example.org"]


def test_the_readme_is_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for heading in ("## The two commands", "## Usage", "## What it buys", "## Exactness", "## Documentation"):
        assert heading in text, heading
    assert "bash scripts/install.sh && hf-vkv demo" in text and "bash scripts/test.sh" in text
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("bash scripts/test.sh")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_cites_an_issue_number(page: Path) -> None:
    found = re.findall(r"\bissues? \d+", page.read_text(), re.I)
    assert not found, f"{page.relative_to(ROOT)} cites {found}: say the fact instead"


def test_every_docs_page_is_in_the_index() -> None:
    index = (ROOT / "docs" / "index.md").read_text()
    for page in sorted((ROOT / "docs").rglob("*.md")):
        name = str(page.relative_to(ROOT / "docs"))
        if name != "index.md":
            assert f"]({name})" in index, f"docs/{name} is not linked from docs/index.md"


_SOURCES = sorted(p for folder in ("hf_vkv", "benchmarks", "tests", "examples", "scripts")
                  for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md"))


@pytest.mark.parametrize("path", _SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_cites_no_issue_number_and_no_file_outside_the_repository(path: Path) -> None:
    text = path.read_text()
    found = re.findall(r"\bissues? \d+", text, re.I)
    assert not found, f"{path.relative_to(ROOT)} cites {found}: say the fact instead"
    outside = [m for m in re.findall(r"(?:[\w/.]*/)?(?:notes/\w+\.md|DESIGN\.md|STYLE\.md)", text)
               if not m.startswith("docs/notes/")]
    assert not outside, f"{path.relative_to(ROOT)} points at {outside}, which the repository does not hold"
