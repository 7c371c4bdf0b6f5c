"""Image files: raw float32, SMV (ADSC) 16-bit with nanoBragg's header, PGM; all written atomically
(`atomic_write`, from nbsim.io.atomic)."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputFileError
from .atomic import atomic_write
from .text import c_atof

SMV_HEADER_BYTES = 512


def write_float_image(path: str | Path, image: np.ndarray) -> None:
    """Raw native-endian float32, slow-major, like nanoBragg's -floatfile."""
    atomic_write(path, np.ascontiguousarray(image, dtype=np.float32).data)


def byte_order() -> str:
    """This machine's byte order as SMV headers spell it."""
    return "little_endian" if sys.byteorder == "little" else "big_endian"


def format_g(value: float) -> str:
    """C's %g."""
    return f"{value:g}"


def smv_header_text(fields: list[tuple[str, str]]) -> bytes:
    """A nanoBragg-style SMV header: `{`, KEY=value; lines, `}`, form feed, space padding to 512 bytes, or to
    the next multiple of 512 that holds the text, which HEADER_BYTES then states (nanoBragg writes such a text
    unpadded after a 512-byte HEADER_BYTES, so readers take part of its header as pixels)."""
    fixed = ["DIM=2;", f"BYTE_ORDER={byte_order()};", "TYPE=unsigned_short;"]
    fixed += [f"{key}={value}" if key == "DIALS_ORIGIN" else f"{key}={value};" for key, value in fields]
    size = SMV_HEADER_BYTES
    while True:
        text = ("\n".join(["{", f"HEADER_BYTES={size};", *fixed]) + "\n}\f").encode("ascii")
        if len(text) <= size:
            return text + b" " * (size - len(text))
        size += SMV_HEADER_BYTES


def write_smv(path: str | Path, image: np.ndarray, fields: list[tuple[str, str]]) -> None:
    """unsigned 16-bit SMV image with the given header keys after SIZE1/SIZE2 are prepended."""
    slow, fast = image.shape
    header = smv_header_text([("SIZE1", str(fast)), ("SIZE2", str(slow)), *fields])
    atomic_write(path, header, np.ascontiguousarray(image, dtype=np.uint16).data)


def write_pgm(path: str | Path, image: np.ndarray, scale: float) -> None:
    """8-bit binary PGM (P5) with a comment giving the scale, like nanoBragg's -pgmfile."""
    slow, fast = image.shape
    header = f"P5\n{fast} {slow}\n# pixels scaled by {scale:g}\n255\n".encode("ascii")
    atomic_write(path, header, np.ascontiguousarray(image, dtype=np.uint8).data)


@dataclass
class SMVHeader:
    text: str
    size: int

    def last_value(self, keyword: str) -> float | None:
        """The number after '=' following the last occurrence of keyword (nanoBragg's ValueOf)."""
        position = self.text.rfind(keyword)
        if position < 0:
            return None
        equals = self.text.find("=", position + len(keyword))
        if equals < 0:
            return 0.0
        return c_atof(self.text[equals + 1:])

    def pixel_counts(self, path: str | Path) -> tuple[int, int]:
        """SIZE1 and SIZE2, fast and slow pixels; a one-line error naming the file unless both are finite
        and at least 1 (a zero or negative size sized a detector of no pixels)."""
        width, height = self.last_value("SIZE1"), self.last_value("SIZE2")
        if width is None or height is None or not (1 <= width < math.inf and 1 <= height < math.inf):
            shown = ", ".join(f"{key}={'none' if value is None else f'{value:g}'}"
                              for key, value in (("SIZE1", width), ("SIZE2", height)))
            raise InputFileError(str(path), f"SMV header has no valid SIZE1/SIZE2 ({shown}; each at least 1)")
        return int(width), int(height)

    def byte_order(self) -> str:
        """The header's BYTE_ORDER (the last one), else this machine's."""
        found = re.findall(r"BYTE_ORDER=(\w+)", self.text)
        return found[-1] if found else byte_order()


def read_head(path: Path, size: int = SMV_HEADER_BYTES) -> bytes:
    """The first `size` bytes of a file (fewer if it is shorter); a one-line error if it cannot be read."""
    try:
        with open(path, "rb") as stream:
            return stream.read(size)
    except FileNotFoundError:
        raise InputFileError(str(path), "no such file") from None
    except OSError as error:
        raise InputFileError(str(path), error.strerror or "cannot be read") from None


def read_smv_header(path: Path) -> SMVHeader:
    """Parse the header of an SMV file; a one-line error if it is missing or not SMV."""
    head = read_head(path)
    if not head.startswith(b"{\nHEADER_BYT") or len(head) < SMV_HEADER_BYTES:
        raise InputFileError(str(path), "not an SMV (ADSC) image")
    text = head.decode("ascii", errors="replace")
    size = SMVHeader(text, SMV_HEADER_BYTES).last_value("HEADER_BYTES")
    if size is None or size < SMV_HEADER_BYTES or size != int(size):
        raise InputFileError(str(path), "SMV header has a bad HEADER_BYTES")
    if size > SMV_HEADER_BYTES:
        with open(path, "rb") as stream:
            text = stream.read(int(size)).decode("ascii", errors="replace")
    return SMVHeader(text.split("}")[0], int(size))


def read_smv(path: Path) -> tuple[SMVHeader, np.ndarray]:
    """Header and (slow, fast) uint16 pixels of an SMV image."""
    header = read_smv_header(path)
    width, height = header.pixel_counts(path)
    raw = Path(path).read_bytes()[header.size:]
    if len(raw) < 2 * width * height:
        raise InputFileError(str(path), f"truncated: {len(raw)} bytes of pixels, expected {2 * width * height}")
    dtype = np.dtype("<u2") if header.byte_order() == "little_endian" else np.dtype(">u2")
    data = np.frombuffer(raw[:2 * width * height], dtype=dtype).reshape(height, width)
    return header, data.astype(np.uint16)
