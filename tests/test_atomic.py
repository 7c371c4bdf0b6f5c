"""nbsim.io.atomic: a file is replaced whole or not at all, and a failed write leaves nothing behind."""

from __future__ import annotations

import os

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

    with pytest.raises(OSError):
        atomic_write_with(path, fail)
    assert path.read_text() == "image.cbf"
    assert [p.name for p in tmp_path.iterdir()] == ["image.cbf"]
