"""The sweep behind the Snakemake workflow, in the order a run uses it:

* `plan` — points, their specs, batches and kernel jobs (torch-free: the Snakefile imports it to build
  the DAG);
* `spec` — `PointSpec`, one point as its batch job receives it (parsed configuration, argv for the C
  binary and the records), and the dataclass ↔ JSON data codec;
* `validate` — the configuration against its schema, what a schema cannot check, every point built;
* `jobs` — job bodies: build kernels, render and time a batch, render its references;
* `store` — JSON records and zarr stores, written atomically;
* `collate` — tables and the collated store, built point by point;
* `report` — what the report shows a reader: the front page's summary per scenario, rounded tables;
* `plots` — speedup, warm time and previews;
* `progress` — a job's log (`logging`) and its progress: points done / total and rate;
* `draws`, `labels` — random draws as an axis (`sweep.draws`) and a dataset's labels;
* `dataset` — reading a collated sweep for training: `open_dataset` and `SweepImages` (a PyTorch Dataset),
  also reachable as `nbsim.sweep.open_dataset` and `nbsim.sweep.SweepImages` (imported on first use: the
  package stays torch-free for the Snakefile).
"""

_DATASET = ("open_dataset", "SweepImages")


def __getattr__(name: str):
    if name in _DATASET:
        from . import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
