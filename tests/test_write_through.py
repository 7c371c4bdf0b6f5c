"""Every output flag writes *into* an existing character device, symbolic link or FIFO, never replacing it
(issue 34: `-floatfile /dev/null` as root once replaced the system's /dev/null with a regular file). The
device here is one the test makes itself (a null device's numbers, in a temporary folder); conftest.py checks
that /dev/null and /dev/zero are untouched by the whole session."""

from __future__ import annotations

import io
import os
import re
import stat
import tempfile
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from nbsim.cli import main
from nbsim.errors import NbsimError
from nbsim.io.atomic import atomic_write, atomic_write_with

OUTPUTS = {"-floatfile": "float.bin", "-intfile": "int.img", "-noisefile": "noise.img", "-pgmfile": "image.pgm",
           "-cbffile": "image.cbf", "-nxmxfile": "image.nxs", "-p1_out": "p1.hkl"}
"""Every flag that writes a file, and the file's name here."""
SMALL = ["-cell", "40", "50", "60", "90", "90", "90", "-N", "3", "-detpixels", "24", "-pixel", "0.3",
         "-distance", "60", "-lambda", "1.0", "-compile", "off", "-seed", "11", "-phi", "5", "-osc", "0.2"]
TIMES = ("start_time", "end_time", "end_time_estimated")
NULL_DEVICE = os.makedev(1, 3)
READER_WAIT_S = 60.0


@pytest.fixture
def private_tempdir(tmp_path, monkeypatch) -> Path:
    """tempfile's folder (where a file for a FIFO or device is built) made a fresh one, to see it left empty."""
    folder = tmp_path / "tempdir"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _table(folder: Path) -> Path:
    path = folder / "table.hkl"
    path.write_text("".join(f"{h} {k} {l} {10 + h + 2 * k + 3 * l}\n"
                            for h in range(-3, 4) for k in range(-3, 4) for l in range(-3, 4)))
    return path


def _render(folder: Path, table: Path) -> None:
    argv = [*SMALL, "-hkl", str(table)]
    for flag, name in OUTPUTS.items():
        argv += [flag, str(folder / name)]
    assert main(argv) == 0


def _comparable(name: str, content: bytes):
    """A file's content with the clock's readings taken out: the miniCBF's start time, the NXmx's times (an
    HDF5 file is compared dataset by dataset)."""
    if name.endswith(".cbf"):
        return re.sub(rb"# \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}", b"# TIME", content)
    if name.endswith(".nxs"):
        values = {}
        with h5py.File(io.BytesIO(content), "r") as nexus:
            nexus.visititems(lambda key, item: values.__setitem__(key, item[()]) if isinstance(item, h5py.Dataset)
                             and key.rsplit("/", 1)[-1] not in TIMES else None)
        return {key: np.asarray(value).tobytes() for key, value in values.items()}
    return content


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """The hkl table and every output written as new regular files."""
    folder = tmp_path_factory.mktemp("regular")
    table = _table(folder)
    _render(folder, table)
    return table, {name: (folder / name).read_bytes() for name in OUTPUTS.values()}


def test_outputs_write_through_symbolic_links_keeping_them(reference, tmp_path, private_tempdir):
    table, expected = reference
    targets, links = tmp_path / "targets", tmp_path / "links"
    targets.mkdir()
    links.mkdir()
    for name in OUTPUTS.values():
        (targets / name).write_bytes(b"old")
        (links / name).symlink_to(Path("..") / "targets" / name)
    _render(links, table)
    for name in OUTPUTS.values():
        assert (links / name).is_symlink() and os.readlink(links / name) == str(Path("..") / "targets" / name)
        assert _comparable(name, (targets / name).read_bytes()) == _comparable(name, expected[name]), name
    assert sorted(p.name for p in targets.iterdir()) == sorted(OUTPUTS.values())
    assert not any(private_tempdir.iterdir())


def _fifo_readers(folder: Path) -> tuple[dict[str, bytes], list[threading.Thread]]:
    received: dict[str, bytes] = {}

    def read(name: str) -> None:
        with open(folder / name, "rb") as stream:
            received[name] = stream.read()

    threads = []
    for name in OUTPUTS.values():
        os.mkfifo(folder / name)
        threads.append(threading.Thread(target=read, args=(name,), daemon=True))
        threads[-1].start()
    return received, threads


def _release(fifo: Path, thread: threading.Thread, wait_s: float = READER_WAIT_S) -> bool:
    """Whether the reader got its end of file within `wait_s`; a reader still waiting for a writer is let go
    (an empty write end opened and closed) so that no thread is left behind."""
    thread.join(wait_s)
    if not thread.is_alive():
        return True
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    thread.join(READER_WAIT_S)
    return False


def test_outputs_stream_into_fifos(reference, tmp_path, private_tempdir):
    table, expected = reference
    received, threads = _fifo_readers(tmp_path)
    _render(tmp_path, table)
    for name, thread in zip(OUTPUTS.values(), threads, strict=True):
        assert _release(tmp_path / name, thread), f"{name}: nothing was written into the FIFO"
        assert stat.S_ISFIFO(os.lstat(tmp_path / name).st_mode), name
        assert _comparable(name, received[name]) == _comparable(name, expected[name]), name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*OUTPUTS.values(), "tempdir"])
    assert not any(private_tempdir.iterdir())


def _null_devices(folder: Path, names) -> None:
    """Character devices with /dev/null's numbers (root only), that a write can open."""
    if os.geteuid() != 0:
        pytest.skip("making a character device (os.mknod) needs root")
    for name in names:
        os.mknod(folder / name, stat.S_IFCHR | 0o666, NULL_DEVICE)
    try:
        os.close(os.open(folder / names[0], os.O_WRONLY))
    except PermissionError:
        pytest.skip(f"{folder} is on a file system mounted nodev: its devices cannot be opened")


def test_outputs_write_into_character_devices_without_replacing_them(reference, tmp_path, private_tempdir):
    table, _ = reference
    names = list(OUTPUTS.values())
    _null_devices(tmp_path, names)
    inodes = {name: os.lstat(tmp_path / name).st_ino for name in names}
    _render(tmp_path, table)
    for name in names:
        now = os.lstat(tmp_path / name)
        assert stat.S_ISCHR(now.st_mode) and now.st_rdev == NULL_DEVICE and now.st_ino == inodes[name], name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, "tempdir"])
    assert not any(private_tempdir.iterdir())


def test_a_link_to_a_device_writes_into_the_device(tmp_path):
    _null_devices(tmp_path, ["null"])
    (tmp_path / "link").symlink_to("null")
    atomic_write(tmp_path / "link", b"bytes")
    atomic_write_with(tmp_path / "link", lambda temporary: temporary.write_bytes(b"file"))
    assert (tmp_path / "link").is_symlink() and stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)


def test_a_failed_write_sends_nothing_into_a_fifo(tmp_path, private_tempdir):
    fifo = tmp_path / "image.nxs"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()

    def fail(temporary: Path) -> None:
        temporary.write_bytes(b"half a file")
        raise OSError("disk full")

    with pytest.raises(NbsimError, match="cannot write .*: disk full"):
        atomic_write_with(fifo, fail)
    assert not _release(fifo, reader, wait_s=0.5), "the failed write opened the FIFO"
    assert received == [b""]
    assert not any(private_tempdir.iterdir())


def test_a_reader_that_goes_away_is_a_one_line_error(tmp_path):
    fifo = tmp_path / "float.bin"
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: os.close(os.open(fifo, os.O_RDONLY)), daemon=True)
    reader.start()
    with pytest.raises(NbsimError, match=r"cannot write .*float.bin: Broken pipe"):
        atomic_write(fifo, b"x" * (1 << 20))
    reader.join(READER_WAIT_S)


def test_a_failed_write_through_a_link_keeps_the_link_and_its_old_target(tmp_path):
    (tmp_path / "target.cbf").write_bytes(b"old")
    (tmp_path / "link.cbf").symlink_to("target.cbf")

    def fail(temporary: Path) -> None:
        temporary.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(NbsimError, match="disk full"):
        atomic_write_with(tmp_path / "link.cbf", fail)
    assert (tmp_path / "link.cbf").is_symlink() and (tmp_path / "target.cbf").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.cbf", "target.cbf"]


def test_a_dangling_link_creates_its_target_and_a_loop_or_socket_is_refused(tmp_path):
    (tmp_path / "link").symlink_to("new.bin")
    atomic_write(tmp_path / "link", b"made")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "new.bin").read_bytes() == b"made"
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(NbsimError, match="loop"):
        atomic_write(tmp_path / "a", b"x")
    (tmp_path / "far").symlink_to(tmp_path / "missing" / "x.bin")
    with pytest.raises(NbsimError, match="missing does not exist"):
        atomic_write(tmp_path / "far", b"x")
    import socket

    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "sock"))
        with pytest.raises(NbsimError, match="it is a socket"):
            atomic_write(tmp_path / "sock", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "far", "link", "new.bin", "sock"]
