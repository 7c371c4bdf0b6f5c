"""Which back-end a compiled render uses (torch-free, so the sweep's planning can ask it too)."""

from __future__ import annotations

import os


def choose_mode(compile: bool, device_type: str, needs_grad: bool) -> str:
    """'eager' when not compiling; 'jit' for gradients or non-CPU devices; 'aot' otherwise.
    NBSIM_COMPILE_MODE=jit|aot overrides the choice (aot still needs no gradients)."""
    if not compile:
        return "eager"
    forced = os.environ.get("NBSIM_COMPILE_MODE")
    if forced == "jit" or needs_grad:
        return "jit"
    if forced == "aot":
        return "aot"
    return "aot" if device_type == "cpu" else "jit"
