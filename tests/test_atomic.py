"""nbsim.io.atomic: a file is replaced whole or not at all, and a failed write leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nbsim.errors import NbsimError
from nbsim.io.atomic import atomic_write, atomic_write_text, atomic_write_with


def test_writes_bytes_and_text_whole_with_the_usual_permissions(tmp_path):
    path = tmp_path / "out.bin"
    atomic_write(path, b"head", memoryview(b"-body"))
    assert path.read_bytes() == b"head-body"
    atomic_write_text(path, "replaced ✓")
    assert path.read_text() == "replaced ✓"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(TypeError):
        atomic_write(path, b"new", "not bytes")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_a_missing_folder_is_a_one_line_error(tmp_path):
    with pytest.raises(NbsimError, match="folder .* does not exist"):
        atomic_write_text(tmp_path / "missing" / "out.txt", "x")


def test_a_library_writer_sees_the_real_name_and_a_failure_leaves_nothing(tmp_path):
    path = tmp_path / "image.cbf"
    atomic_write_with(path, lambda temporary: temporary.write_text(temporary.name))
    assert path.read_text() == "image.cbf"

    def fail(temporary):
        temporary.write_text("half")
        raise OSError("disk full")

    with pytest.raises(NbsimError, match="disk full"):
        atomic_write_with(path, fail)
    assert path.read_text() == "image.cbf"
    assert [p.name for p in tmp_path.iterdir()] == ["image.cbf"]



CANCELLED_WRITER = """
import itertools, os, random, signal, sys, threading, time
from pathlib import Path
from nbsim.io.atomic import atomic_write

class Cancelled(BaseException):
    pass

def cancel(signum, frame):
    raise Cancelled

folder = Path(sys.argv[1])
names = [f"out{index}.bin" for index in range(3)]
for name in names:
    atomic_write(folder / name, bytes(100))
rng = random.Random(7)
for writer in range(int(sys.argv[2])):
    pid = os.fork()
    if pid == 0:
        try:
            if writer % 3:  # every third writer keeps SIGTERM's default action, as a plain nbsim process
                signal.signal(signal.SIGTERM, cancel)
            if writer % 2:  # a second thread, idle, as a render's thread pool: it may take the SIGTERM
                threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
            for index in itertools.count():
                atomic_write(folder / names[index % 3], bytes(100))
        finally:
            os._exit(0)
    time.sleep(rng.uniform(0.001, 0.006))
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    if writer % 3 == 0 and os.waitstatus_to_exitcode(status) != -signal.SIGTERM:
        sys.exit(f"a writer under the default action ended with {status}, not by SIGTERM")
    found = sorted(path.name for path in folder.iterdir())
    if found != names or any(path.stat().st_size != 100 for path in folder.iterdir()):
        sys.exit(f"left behind: {found}")
"""


def test_a_cancel_at_any_moment_leaves_no_temporary_folder(tmp_path):
    """A writer cancelled (SIGTERM raising, as in the worker's command processes) at random moments of a
    loop of small writes leaves whole files and no temporary folder, whichever step the cancel lands in:
    the folder's creation, the write, the rename or the cleanup. Every other writer has a second thread, as
    a render's thread pool has, which may take the signal (Python still runs the handler in the main
    thread). Every third writer keeps SIGTERM's default action (a plain `nbsim` process ended by Snakemake or
    SLURM): it still ends by SIGTERM, its temporary folder removed first. The writers are forked from a fresh
    interpreter of one thread, not from the test's own process."""
    run = subprocess.run([sys.executable, "-c", CANCELLED_WRITER, str(tmp_path), "250"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
