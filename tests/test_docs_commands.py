"""Every command block of README.md and docs/*.md runs as written, or says why it is not run here.

A ```sh (or ```bash) block is run by bash (-e: every command must succeed) in a fresh folder holding the
repository's `config/`, with `.venv/bin/nbsim` (this checkout's entry point, `nbsim.server.client:main`, as
installed), `.venv/bin/python` this Python, and a private NBSIM_CACHE_DIR (its own kernels and worker socket,
so a worker the docs start serves only these commands), as a clone whose venv is not activated: no `nbsim`,
`snakemake` or `pytest` on PATH, so a block that names one bare fails as it would for a reader. An HTML comment on
the line before the block marks one that is not run as it stands: `<!-- needs: DIALS -->` runs only where
DIALS is installed, `<!-- not run: REASON -->` never (REASON says what it needs, and the text around the
block says where to get it). A block that repeats another's script word for word runs once."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

DOCUMENTS = (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"^<!-- (needs|not run): (.+?) -->$")
SHELLS = ("sh", "bash", "shell", "console")
NEEDS = {"DIALS": ("dials.import", "cctbx.python")}
"""What a `needs:` marker may name, and the programs that must be on PATH to run the block."""
VENV_PROGRAMS = ("nbsim", "snakemake", "pytest", "python", "ruff")
"""Programs a clone has in .venv/bin only: the documents write them `.venv/bin/NAME` (the README's way)."""
COMMAND_START = re.compile(r"(?:^|[;&|(]|\$\()\s*(\S+)", re.M)


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    script: str
    marker: tuple[str, str] | None
    """(needs | not run, what), from the comment on the line before the block."""

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"


def command_blocks() -> list[Block]:
    """Every shell block of the documents, with its marker."""
    blocks = []
    for document in DOCUMENTS:
        text = document.read_text()
        for fence in FENCE.finditer(text):
            if fence.group(1) not in SHELLS:
                continue
            before = text[:fence.start()].rstrip("\n").splitlines()
            marker = MARKER.match(before[-1]) if before else None
            blocks.append(Block(str(document.relative_to(REPO_ROOT)), text.count("\n", 0, fence.start()) + 1,
                                fence.group(2), marker.groups() if marker else None))
    return blocks


def distinct(blocks: list[Block]) -> list[Block]:
    """The blocks with a script no earlier block has (the README repeats a page's commands: run them once)."""
    seen: set[str] = set()
    kept = []
    for block in blocks:
        if block.script not in seen:
            seen.add(block.script)
            kept.append(block)
    return kept


BLOCKS = command_blocks()
RUN = distinct([block for block in BLOCKS if block.marker is None or block.marker[0] == "needs"])


def test_every_block_is_run_or_says_why_not():
    assert len(BLOCKS) >= 10, "the documents' command blocks were found"
    for block in BLOCKS:
        if block.marker is None:
            continue
        kind, what = block.marker
        if kind == "needs":
            assert what in NEEDS, f"{block.name}: needs '{what}', which this test cannot provide ({', '.join(NEEDS)})"
        else:
            assert len(what.split()) >= 3, f"{block.name}: 'not run' must say what the block needs"
    assert len(RUN) >= 5, "blocks run"


def test_blocks_name_the_venvs_programs_by_their_path():
    """`nbsim ...` is "command not found" unless the reader activated the venv: every block, run or not,
    starts nbsim, snakemake, pytest and python as `.venv/bin/NAME`."""
    for block in BLOCKS:
        script = re.sub(r"#.*", "", re.sub(r"\\\n\s*", " ", block.script))  # continuation lines joined, comments out
        bare = [word for word in COMMAND_START.findall(script) if word in VENV_PROGRAMS]
        assert not bare, f"{block.name}: write .venv/bin/{bare[0]}, not {bare[0]}"


def test_blocks_in_other_fences_are_not_commands():
    """Commands hide in no other fence: a block starting with a command nbsim documents is a shell block."""
    for document in DOCUMENTS:
        for fence in FENCE.finditer(document.read_text()):
            if fence.group(1) in SHELLS or fence.group(1) in ("python", "yaml", "json", "text"):
                continue
            first = fence.group(2).lstrip().split(maxsplit=1)[:1]
            assert first not in (["nbsim"], [".venv/bin/nbsim"], ["dials.import"], ["make"]), (
                f"{document.name}: a command block fenced as '{fence.group(1)}'")


@pytest.fixture(scope="module")
def nbsim_entry(tmp_path_factory) -> Path:
    """This checkout's entry point as a script (not on PATH: the blocks call it as .venv/bin/nbsim)."""
    nbsim = tmp_path_factory.mktemp("tools") / "nbsim"
    nbsim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "import sys; from nbsim.server.client import main; '
                     f'sys.exit(main())" "$@"\n')
    nbsim.chmod(0o755)
    return nbsim


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory, nbsim_entry) -> dict[str, str]:
    """PATH without a folder that holds an nbsim (an activated venv's bin), PYTHONPATH the checkout, a private
    cache folder."""
    path = [folder for folder in os.environ["PATH"].split(os.pathsep) if not (Path(folder) / "nbsim").exists()]
    env = {**os.environ, "PATH": os.pathsep.join(path), "PYTHONPATH": str(REPO_ROOT),
           "NBSIM_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}
    yield env
    subprocess.run([str(nbsim_entry), "worker", "stop"], env=env, capture_output=True, timeout=60)


def _folder(tmp_path: Path, nbsim_entry: Path) -> Path:
    """A working folder as a clone's root: config/ and .venv/bin/{nbsim, python}."""
    (tmp_path / "config").symlink_to(REPO_ROOT / "config")
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "nbsim").symlink_to(nbsim_entry)
    (venv / "python").symlink_to(sys.executable)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=[block.name for block in RUN])
def test_documented_commands_run(block, tmp_path, shell_env, nbsim_entry):
    if block.marker is not None:
        missing = [program for program in NEEDS[block.marker[1]] if shutil.which(program) is None]
        if missing:
            pytest.skip(f"{block.name} needs {block.marker[1]} ({', '.join(missing)} not on PATH)")
    folder = _folder(tmp_path, nbsim_entry)
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.script], cwd=folder, env=shell_env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.name}:\n{block.script}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
