"""Structure factors from many stills (docs/merging.md): `Merge`, the ensemble refinement of the asymmetric
unit's |F| (with `anomalous`, F(+) and F(−) apart) together with every shot's model, by modelling every
shoebox pixel, the sums over shots all-reduced over worker processes (`launch`); `write_mtz` and
`merge_json`, what it writes."""

from .distributed import launch
from .model import Restraints, StructureFactorModel
from .output import merge_json, write_mtz
from .refine import Merge, MergeJob, MergeOptions, MergeResult, job_fingerprint
from .reflections import Reflections, asymmetric_unit, space_group

__all__ = ["Merge", "MergeJob", "MergeOptions", "MergeResult", "Reflections", "Restraints", "StructureFactorModel",
           "asymmetric_unit", "job_fingerprint", "launch", "merge_json", "space_group", "write_mtz"]
