"""What this machine's processor is: its name and the instruction-set extensions compiled code may use."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

_ISA_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "sse4_2", "amx_tile")


@functools.cache
def _cpuinfo_field(name: str) -> str | None:
    """The value of the first `name` line of /proc/cpuinfo, or None where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo, else what `platform` says)."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> str:
    """The extensions (of those a compiled kernel may use) that this processor has, comma-separated."""
    flags = _cpuinfo_field("flags")
    if flags is None:
        return platform.processor()
    present = set(flags.split())
    return ",".join(flag for flag in _ISA_FLAGS if flag in present)
