"""The compile setting and the back-end a render runs on, each one enum with one spelling inside nbsim
(torch-free, so the sweep's planning can ask it too). Callers' spellings (True/False, "on"/"off", YAML's
bare on/off) are turned into a `Compile` at the boundary by `Compile.of`."""

from __future__ import annotations

import os
from enum import Enum


class Compile(str, Enum):
    """Whether to run a compiled kernel: always, never, or when it is cached or building it pays."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    @classmethod
    def of(cls, value: Compile | bool | str) -> Compile:
        """The setting a caller means: a Compile, True/False, or "auto", "on"/"true"/"yes", "off"/"false"/"no"."""
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        text = str(value).strip().lower()
        spelled = {"auto": cls.AUTO, "on": cls.ON, "true": cls.ON, "yes": cls.ON, "1": cls.ON, "off": cls.OFF,
                   "false": cls.OFF, "no": cls.OFF, "0": cls.OFF}
        if text not in spelled:
            raise ValueError(f"compile must be auto, on or off (got {value!r})")
        return spelled[text]

    def __str__(self) -> str:
        return self.value


class Mode(str, Enum):
    """Where a render's kernel runs: eagerly, just-in-time compiled, or from an ahead-of-time package."""

    EAGER = "eager"
    JIT = "jit"
    AOT = "aot"

    def __str__(self) -> str:
        return self.value


def compiled_gradients_forced() -> bool:
    """NBSIM_COMPILE_MODE=jit: a compiled render with gradients compiles its backward too (minutes per
    structure, docs/kernels.md); otherwise renders with gradients are eager."""
    return os.environ.get("NBSIM_COMPILE_MODE") == "jit"


def choose_mode(compile: Compile | bool | str, device_type: str, needs_grad: bool) -> Mode:
    """EAGER when not compiling; JIT for gradients or non-CPU devices; AOT otherwise (`auto` is asked as
    if compiling). NBSIM_COMPILE_MODE=jit|aot overrides the choice (aot still needs no gradients)."""
    if Compile.of(compile) is Compile.OFF:
        return Mode.EAGER
    forced = os.environ.get("NBSIM_COMPILE_MODE")
    if forced == "jit" or needs_grad:
        return Mode.JIT
    if forced == "aot":
        return Mode.AOT
    return Mode.AOT if device_type == "cpu" else Mode.JIT
