"""Random draws as a sweep axis: `sweep.draws: {count, seed, values}`, each draw one point.

Draw `k` of a sweep with seed `S` is computed from (S, k) alone, never from the draws before it: every value
comes from its own counter-based generator (numpy's Philox, keyed by a `SeedSequence` of S, k and the value's
key), so one point is reproduced alone, and adding a key changes no other key's values. The draw's seeds
(noise, mosaic, misset, calibration) come from the same sequence. Torch-free (the Snakefile imports it).

Distributions (the value under a key): `random` (for `-misset` only: an orientation uniform on SO(3)),
`{uniform: [lo, hi]}` (lo <= x < hi), `{integers: [lo, hi]}` (lo <= n <= hi, both included),
`{normal: [mean, sd]}`, `{choice: [a, b, ...]}` (each equally likely), and, for the `spectrum` option
only, `{sase: {centre_A or centre_eV, bandwidth_percent, channels, spikes (default 10)}}`: a seeded
SASE-like spectrum (nbsim.model.spectra.sase_spectrum). The orientation is drawn from the draw's misset seed
alone, so that seed reproduces it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import NbsimError
from ..io.text import HC_EV_A
from ..model.spectra import sase_spectrum
from ..rng import matrix_to_misset_rad

DISTRIBUTIONS = ("uniform", "integers", "normal", "choice", "sase")
SPECTRUM = "spectrum"
"""The option a `sase` draw gives (BeamConfig.spectrum)."""
SEED_NAMES = ("noise", "mosaic", "misset", "calibration")
RANDOM_ORIENTATION = "-misset"
"""The one key that takes `random`: the crystal's orientation, drawn here and rendered as misset angles."""
SEED_LIMIT = 2**31 - 1
"""Seeds are positive 31-bit integers, as nanoBragg's (negated) ran1 seeds."""


@dataclass(frozen=True)
class Draw:
    """One draw: its index, its values by key (in sorted key order; `-misset` as the three misset angles in
    degrees) and its seeds by name."""

    index: int
    values: tuple[tuple[str, Any], ...]
    seeds: tuple[tuple[str, int], ...]


def _sequence(seed: int, index: int, key: str) -> np.random.SeedSequence:
    return np.random.SeedSequence(int(seed), spawn_key=(int(index), zlib.crc32(key.encode())))


def _generator(seed: int, index: int, key: str) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(_sequence(seed, index, key)))


def random_rotation(generator: np.random.Generator) -> np.ndarray:
    """A rotation matrix uniform on SO(3): a unit quaternion from four normal deviates (Shoemake)."""
    w, x, y, z = (q := generator.standard_normal(4)) / np.linalg.norm(q)
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                     [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                     [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])


def random_misset_deg(misset_seed: int) -> tuple[float, float, float]:
    """The misset angles (x, y, z rotations, degrees, as `-misset`) of the orientation drawn from `misset_seed`."""
    rotation = random_rotation(np.random.Generator(np.random.Philox(misset_seed)))
    return tuple(math.degrees(a) for a in matrix_to_misset_rad(rotation))


def draw_value(spec: Any, generator: np.random.Generator) -> Any:
    """One value of a distribution (checked by `check_draws`)."""
    (name, arguments), = spec.items()
    if name == "uniform":
        return float(generator.uniform(*arguments))
    if name == "integers":
        return int(generator.integers(arguments[0], arguments[1], endpoint=True))
    if name == "normal":
        return float(generator.normal(*arguments))
    if name == "sase":
        centre_A = arguments["centre_A"] if "centre_A" in arguments else HC_EV_A / arguments["centre_eV"]
        return sase_spectrum(centre_A, arguments["bandwidth_percent"], int(arguments["channels"]),
                             int(generator.integers(1, SEED_LIMIT)), int(arguments.get("spikes", 10)))
    return arguments[int(generator.integers(len(arguments)))]


def draw(draws: dict, index: int) -> Draw:
    """Draw `index` of `sweep.draws`."""
    seed = int(draws.get("seed", 0))
    state = _sequence(seed, index, "seeds").generate_state(len(SEED_NAMES), np.uint32)
    seeds = tuple((name, int(word) % SEED_LIMIT + 1) for name, word in zip(SEED_NAMES, state, strict=True))
    values = tuple((key, random_misset_deg(dict(seeds)["misset"]) if spec == "random"
                    else draw_value(spec, _generator(seed, index, key)))
                   for key, spec in sorted((draws.get("values") or {}).items()))
    return Draw(index, values, seeds)


def draw_count(config: dict) -> int:
    """How many draws the sweep has (0 without `sweep.draws`)."""
    return int((config["sweep"].get("draws") or {}).get("count", 0))


def check_draws(draws: dict, base: Path) -> None:
    """What the schema (workflow/schemas/config.schema.yaml, which gives every distribution's shape) cannot
    say about `sweep.draws`, one line naming the key: `random` for `-misset` alone and `sase` for `spectrum`
    alone, lo <= hi, one centre of a `sase` spectrum, and `choice` files that exist (a choice of a file
    flag: `-hkl`, `-mat`, ...; relative to the config's folder)."""
    from ..nanobragg.flags import FLAGS, PATH

    for key, spec in (draws.get("values") or {}).items():
        where = f"sweep.draws.values.{key}"
        if (spec == "random") != (key == RANDOM_ORIENTATION):
            raise NbsimError(f"{where}: 'random' draws the orientation, for -misset alone; other keys take a "
                             f"distribution ({', '.join(DISTRIBUTIONS)})")
        if spec == "random":
            continue
        (name, arguments), = spec.items()
        if (name == "sase") != (key == SPECTRUM):
            raise NbsimError(f"{where}: 'sase' draws a spectrum, for the option {SPECTRUM} alone; "
                             f"{SPECTRUM} takes 'sase'")
        if name == "sase" and len({"centre_A", "centre_eV"} & set(arguments)) != 1:
            raise NbsimError(f"{where}.sase: give one of centre_A and centre_eV")
        if name == "choice" and FLAGS.get(key) == (PATH,):
            missing = [value for value in arguments if not (base / str(value)).is_file()]
            if missing:
                raise NbsimError(f"{where}.choice: file {missing[0]} does not exist")
        if name in ("uniform", "integers") and arguments[0] > arguments[1]:
            raise NbsimError(f"{where}.{name}: lo {arguments[0]} > hi {arguments[1]}")
