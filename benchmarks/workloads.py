"""The reference workloads benchmarks, tests and examples start from, as nanoBragg arguments without a
detector size: the seeds' benchmark (one step per pixel) and the heavy one (300 steps per pixel)."""

SEED_ARGS = ("-default_F", "100", "-cell", "100", "100", "100", "90", "90", "90", "-lambda", "6.2", "-N", "5",
             "-distance", "100")
HEAVY_ARGS = ("-hkl", "{golden}/synthetic_P1.hkl", "-cell", "70", "80", "90", "75", "85", "95",
              "-misset", "10", "20", "30", "-N", "10", "-lambda", "1.5", "-distance", "200", "-pixel", "0.1",
              "-mosaic", "0.3", "-mosaic_dom", "5", "-mosaic_seed", "3", "-phi", "0", "-osc", "0.3",
              "-phisteps", "3", "-hdivrange", "0.2", "-vdivrange", "0.2", "-hdivsteps", "3", "-vdivsteps", "3",
              "-oversample", "2")
"""`{golden}` stands for the folder holding synthetic_P1.hkl (../shared/golden)."""
