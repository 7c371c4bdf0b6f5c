# Two commands on a fresh machine:
#   make sweep   # builds .venv, runs the default sweep (config/config.yaml) and writes results/report.html
#   make test    # builds .venv, runs the whole test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of PyTorch, the only version CI tests; nbsim needs torch>=2.8 (docs/requirements.md).
TORCH_SPEC ?= torch==2.13.0
CORES ?= 2
STAMP := $(VENV)/.installed

.PHONY: venv sweep report test lint bench wheelhouse gpu-campaign-cpu clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[pipeline,test]"
	touch $(STAMP)

venv: $(STAMP)

sweep: $(STAMP)
	$(BIN)/snakemake --workflow-profile workflow/profiles/default --cores $(CORES)
	$(BIN)/snakemake --report results/report.html

report: $(STAMP)
	$(BIN)/snakemake --report results/report.html

test: $(STAMP)
	$(BIN)/python -m pytest -n $(CORES) --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check nbsim tests workflow/scripts benchmarks
	$(BIN)/snakemake --lint

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

# The GPU campaign (benchmarks/gpu_campaign.sh) runs on a lent machine that reaches no package registry and
# whose image ships PyTorch and most of nbsim's needs for Python 3.12: wheelhouse/ (git-ignored) carries the
# rest, built here. DEVICE_SHIPS is what that image already has (not carried, to stay within the 64 MiB a
# call carries); pulp (Snakemake's ILP scheduler: the campaign runs the greedy one) and hdf5plugin (fabio's
# HDF5 filters, unused by nbsim) are left out for their size.
DEVICE_PYTHON ?= python3.12
WHEELHOUSE_NEEDS := "snakemake>=9" "zarr>=3" "gemmi>=0.7" "fabio>=2024.1" "cfelpyutils>=2.2" "jsonschema>=4"
DEVICE_SHIPS := attrs certifi charset_normalizer filelock h5py idna jinja2 lxml markupsafe mypy_extensions numpy \
	packaging pandas pillow psutil python_dateutil pyyaml requests tabulate typing_extensions urllib3 wrapt \
	pulp hdf5plugin

wheelhouse:
	rm -rf wheelhouse
	$(DEVICE_PYTHON) -m pip wheel --quiet --wheel-dir wheelhouse $(WHEELHOUSE_NEEDS)
	cd wheelhouse && rm -f $(addsuffix -*.whl,$(DEVICE_SHIPS))
	du -sh wheelhouse

gpu-campaign-cpu: $(STAMP)
	PYTHON=$(BIN)/python bash benchmarks/gpu_campaign.sh --cpu

clean:
	rm -rf results .snakemake
