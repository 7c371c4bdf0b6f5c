"""The checkout's shape: the root holds only what README.md names, and no test writes into the checkout."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from .conftest import REPO_ROOT


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout (or no git): the tracked files are unknown")
    listing = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return listing.stdout.splitlines()


def test_root_holds_only_what_the_readme_names():
    readme = (REPO_ROOT / "README.md").read_text()
    named = set(re.findall(r"`\.?([\w.-]+)/?`", readme)) | set(re.findall(r"\]\(([\w.-]+)\)", readme))
    root_entries = {path.split("/")[0] for path in _tracked_files()}
    unnamed = sorted(entry for entry in root_entries if entry.lstrip(".") not in named and entry not in named)
    assert not unnamed, f"tracked at the repository root but not named in README.md: {unnamed}"
