"""The user docs stay inside the repository: every link in README.md, docs/ and benchmarks/README.md points to
a file of this checkout, never outside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_resolves_inside_the_repository(page):
    for target in LINK.findall(page.read_text()):
        assert "://" not in target and not target.startswith("mailto:"), f"{page.name}: {target} leaves the repository"
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(ROOT), f"{page.name}: {target} points outside the repository"
        assert path.exists(), f"{page.name}: {target} does not exist"


def test_the_readme_stays_an_entry_point():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
