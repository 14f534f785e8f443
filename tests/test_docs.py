"""The README, which mkdocs does not build: it keeps the two set-up commands and the quick start,
and every link in it reaches a file of the repository (most point into docs/, whose own links
`make docs` checks with --strict)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_keeps_the_two_commands_and_the_quick_start():
    assert "## Quick start" in README
    assert re.search(r"^make demo +# ", README, re.M)
    assert re.search(r"^make test +# ", README, re.M)


def test_readme_links_reach_files():
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert any(link.startswith("docs/") for link in local)
    missing = [
        link for link in local if not (ROOT / link.split("#")[0]).exists() or link.startswith("#")
    ]
    assert not missing, f"README links to nothing: {missing}"
