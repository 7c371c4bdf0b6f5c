"""`nbsim`: a nanoBragg-compatible command line (same flags, same output files), plus `nbsim show`,
`nbsim bench`, `nbsim kernels`, `nbsim fit`, `nbsim merge`, `nbsim export` and `nbsim worker` (served by
server/client.py).

Everything the arguments alone decide (help, an unknown flag, a bad value, an impossible cell, a missing
input file, an output folder that does not exist) is answered here without importing torch, in a
fraction of a second; nbsim.cli.simulate then sets up, renders and writes.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback

from ..config import DetectorConfig, SimulationConfig, scalar_value
from ..errors import NbsimError
from ..io.paths import check_writable, is_stream, require_file
from ..nanobragg.arguments import RunOptions, parse
from ..nanobragg.flags import flag_help

USAGE = """usage: nbsim [nanoBragg options] [-device cpu|cuda] [-dtype float32|float64] [-compile auto|on|off]
       nbsim show [--options] -- <nanoBragg options>   (what a command resolves to, without rendering)
       nbsim kernels build|list   (see nbsim kernels -h)
       nbsim bench [--device D] [--dtype T] [--repeats N] [--warmup K] [--compile on|off|auto]
                   [--threads N] [--floatfile F] [--c-binary PATH] [--json F] -- <nanoBragg options>
       nbsim worker start|stop|status   (a resident process that serves nbsim commands)
       nbsim fit IMAGE... [--refine orientation,cell,N,scale] [--json F] -- <nanoBragg options>
                   (refine a model against observed images; nbsim fit -h)
       nbsim merge SHOT... --starts F --hkl START --space_group SG [--anomalous] --mtz OUT -- <nanoBragg options>
                   (structure factors refined over many stills; nbsim merge -h)
       nbsim export SWEEP_ZARR [--nxmx FILE] [--cbf PREFIX] [--noise-nxmx FILE] [--noise-cbf PREFIX]
                   (a sweep's rotation series for DIALS/XDS; see nbsim export -h)

nbsim renders the image nanoBragg renders for the same options and writes the same files
(-floatfile, -intfile, -pgmfile, -noisefile; nanoBragg's default names when not given), and, for
processing software (DIALS, XDS, CrystFEL), -cbffile F (miniCBF) and -nxmxfile F (NeXus NXmx HDF5): the
noise image's counts (the -intfile image's under -nonoise) with the geometry in the header, as int32 counts: no
-adc pedestal unless -adc is given, clamped at -saturation, not 65535 (docs/formats.md).
-noisefile is nanoBragg's noise image, bit for bit, unless detector effects are asked for (docs/detector.md):
-noise_generator nanobragg|philox, -nopoisson, -flicker F, -calibration F [-calibration_seed N],
-psf gaussian|fiber -psf_fwhm UM, -gain ADU_PER_PHOTON, -readout_noise ADU, -beamstop RADIUS_MM,
-hot_pixels F, -dead_pixels F [-defect_seed N] (F: a fraction from 0 to 1).
-panelfile FILE renders a multi-panel detector (nbsim's YAML panel list or a CrystFEL .geom file), written by
-floatfile (the panels stacked), -nxmxfile (its noise counts, as for one panel) and -noisefile FILE (the noise
image), both NXmx of one module per panel; each panel is read out with the detector flags above, its point spread
and beam stop its own (docs/formats.md, docs/detector.md).
Add --debug (or set NBSIM_DEBUG=1) to see a traceback on errors.

Options (units and defaults as in nanoBragg; every flag is one of these):
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line errors and a non-zero status instead of tracebacks."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or bool(os.environ.get("NBSIM_DEBUG"))
    argv = [a for a in argv if a != "--debug"]
    try:
        if argv and argv[0] == "bench":
            from .bench import main as bench_main

            return bench_main(argv[1:])
        if argv and argv[0] == "kernels":
            from .kernels import main as kernels_main

            return kernels_main(argv[1:])
        if argv and argv[0] == "show":
            from .show import main as show_main

            return show_main(argv[1:], checked_arguments)
        if argv and argv[0] == "fit":
            from .fit import main as fit_main

            return fit_main(argv[1:])
        if argv and argv[0] == "merge":
            from .merge import main as merge_main

            return merge_main(argv[1:])
        if argv and argv[0] == "export":
            from .export import main as export_main

            return export_main(argv[1:])
        if argv and argv[0] in ("--version", "-version"):
            from .. import __version__

            print(f"nbsim {__version__}")
            return 0
        if not argv or argv[0] in ("-h", "--help", "-help"):
            print(USAGE + flag_help())
            return 0 if argv else 2
        config, run = checked_arguments(argv)
        from .simulate import render_command

        return render_command(config, run)
    except NbsimError as error:
        if debug:
            traceback.print_exc()
        print(f"nbsim: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nbsim: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of the output went away (`nbsim -h | head`): stop quietly, as other tools do, with
        # stdout pointed at /dev/null so that the interpreter's final flush does not fail again.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as error:  # noqa: BLE001 - the CLI's last line of defence
        if debug:
            traceback.print_exc()
        out_of_memory = _out_of_memory(error)
        if out_of_memory:
            print(f"nbsim: error: {out_of_memory}", file=sys.stderr)
            return 2
        first_line = (str(error).strip().splitlines() or [""])[0]
        print(f"nbsim: internal error: {type(error).__name__}: {first_line} (rerun with --debug for details)",
              file=sys.stderr)
        return 1


def _out_of_memory(error: Exception) -> str:
    """The message for an allocation that failed, else "": Python's and NumPy's MemoryError, PyTorch's
    OutOfMemoryError (CUDA) and its CPU allocator's RuntimeError, which has no class of its own. A
    detector or a sampling too large for the machine is the command's size, not a fault of nbsim."""
    text = str(error)
    if not (isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"
            or "can't allocate memory" in text):
        return ""
    size = re.search(r"[Tt]ried to allocate ([\d.]+ ?\w+)", text)
    return (f"out of memory{f' (an array of {size[1]})' if size else ''}: render fewer pixels or steps "
            "(-detpixels, -roi, -oversample, -mosaic_domains, -phisteps) or on a -device with more memory")


def checked_arguments(argv: list[str]) -> tuple[SimulationConfig, RunOptions]:
    """The configuration and output options, once every check that needs no rendering has passed."""
    config, run = parse(argv)
    for path in run.outputs(panels=False).values():
        check_writable(path)
    _refuse_shared_outputs(config, run)
    for path in (config.structure.hkl_file, config.structure.model_file, config.detector.mask_file):
        if path is not None:
            require_file(path)
    if run.cbffile:
        refuse_tilted_mini_cbf(config.detector)
    return config, run


def _refuse_shared_outputs(config: SimulationConfig, run: RunOptions) -> None:
    """Two outputs named as one file are refused: the later write would replace the earlier whole (nanoBragg
    writes both, one over the other), leaving a file that reads as one output and nothing of the other. A
    FIFO or device (/dev/null) takes any number; -intfile and -pgmfile are not written for a -panelfile."""
    written_by: dict[str, str] = {}
    for flag, path in run.outputs(config.detector.panels is not None).items():
        if is_stream(path):
            continue
        earlier = written_by.setdefault(os.path.realpath(path), flag)
        if earlier != flag:
            raise NbsimError(f"{earlier} and {flag} both write {path}: give each output a file of its own")


def refuse_tilted_mini_cbf(detector: DetectorConfig) -> None:
    """A miniCBF describes a detector square to the beam with its convention's axes (its Detector_distance
    and Beam_xy; dxtbx builds it so): one turned by -twotheta or -detector_rot*, or given custom vectors,
    is refused with the arguments, before anything is printed or rendered, with the format that can hold it."""
    turned = [scalar_value(angle) for angle in (detector.twotheta_deg, *detector.rotation_deg)]
    if any(angle != 0.0 for angle in turned) or detector.convention == "custom":
        raise NbsimError("-cbffile: a miniCBF can only describe a detector square to the beam, and this one is "
                         "tilted (-twotheta, -detector_rot* or custom vectors); write -nxmxfile instead")
