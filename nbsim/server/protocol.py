"""What the `nbsim` client (nbsim.server.client) and the resident worker (nbsim.server.worker) share, so that
neither imports the other: where the worker listens, which sources it serves, and the messages between
them. Torch-free, like the client.

A client connects to the worker's socket and sends one request, a line of JSON (`{"command": "run",
...}`, `"status"` or `"stop"`), then nothing more: anything it sends later, or its hang-up, tells the
worker that it has gone. The worker answers with frames, each a kind byte and a length (HEADER) then
that many bytes of UTF-8: STDOUT and STDERR text, then EXIT with the command's status as JSON; or
DECLINE with a note for the client to print before it runs the command in its own process.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import socket
import stat
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

from ..cache import cache_dir, sources_digest, torch_version_file

DEFAULT_IDLE_TIMEOUT_S = 1800.0
HEADER = struct.Struct("!cI")
STDOUT, STDERR, EXIT, DECLINE = b"o", b"e", b"x", b"d"


def idle_timeout(text: str) -> float:
    """The --idle-timeout option's type: a positive number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return seconds


def socket_path() -> Path:
    """Where the worker for this user and cache folder listens (short enough for AF_UNIX)."""
    folder = cache_dir().expanduser().resolve()
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    return Path("/tmp") / f"nbsim-{os.getuid()}" / f"worker-{digest}.sock"


def private_folder(path: Path) -> bool:
    """Make the socket's folder (mode 700) if needed; False unless it is a real folder of this user
    that nobody else can enter."""
    with contextlib.suppress(FileExistsError):
        path.parent.mkdir(mode=0o700)
    folder = path.parent.lstat()
    return stat.S_ISDIR(folder.st_mode) and folder.st_uid == os.getuid() and folder.st_mode & 0o077 == 0


def refuse_shared_folder(path: Path) -> int:
    """The one-line error and status for a socket folder that private_folder rejects."""
    print(f"nbsim: error: {path.parent} is not a private folder of this user", file=sys.stderr)
    return 1


def source_digest() -> str:
    """The interpreter, PyTorch's version file and nbsim's sources (found without importing torch): a
    worker serves only clients with the same ones."""
    digest = hashlib.sha256(sys.executable.encode())
    digest.update(sources_digest().encode())
    version_file = torch_version_file()
    if version_file is not None:
        digest.update(version_file.read_bytes())
    return digest.hexdigest()


def connect(timeout_s: float | None = None) -> socket.socket | None:
    """A connection to this user's worker, or None when none listens in a private folder."""
    path = socket_path()
    if not path.exists() or not private_folder(path):
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(timeout_s)
    try:
        connection.connect(str(path))
    except OSError:
        connection.close()
        return None
    return connection


def send_request(connection: socket.socket, message: dict) -> None:
    """Send one message to the worker: a JSON line."""
    connection.sendall(json.dumps(message).encode() + b"\n")


def read_request(connection: socket.socket) -> dict:
    """The client's request line ({} when it hung up without one)."""
    return json.loads(connection.makefile("rb").readline() or b"{}")


def send_frame(connection: socket.socket, kind: bytes, text: str) -> None:
    """One frame; raises OSError when the client has gone."""
    payload = text.encode()
    connection.sendall(HEADER.pack(kind, len(payload)) + payload)


def frames(connection: socket.socket) -> Iterator[tuple[bytes, bytes]]:
    """(kind, payload) frames until the connection closes."""
    reader = connection.makefile("rb")
    while True:
        header = reader.read(HEADER.size)
        if len(header) < HEADER.size:
            return
        kind, length = HEADER.unpack(header)
        yield kind, reader.read(length)
