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

.PHONY: venv sweep report test lint bench wheelhouse gpu-campaign-cpu fit-paths torch-range clean

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
	$(BIN)/python -m pytest -n $(CORES) --dist loadfile --no-loadscope-reorder --durations=25

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
WHEELHOUSE_NEEDS := "snakemake>=9" "zarr>=3" "gemmi>=0.7" "fabio>=2024.1" "cfelpyutils>=2.2" "jsonschema>=4" "pytest-xdist>=3"
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

# The fits whose convergence once depended on the processor (issue 41: benchmarks/gpu_campaign.py's
# CONVERGENCE_TESTS, which a lent machine's campaign runs on its own processor), on this machine's processor
# under other processors' kernel selections: each FIT_PATHS entry picks PyTorch's vector kernels
# (ATEN_CPU_CAPABILITY), scipy's OpenBLAS kernels (OPENBLAS_CORETYPE, L-BFGS-B's) and MKL's code path (MKL_CBWR),
# so the fits meet other roundings than the processor's own (docs/fitting.md, "Processors"). Not in CI (3 min).
FIT_PATHS ?= "ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell MKL_CBWR=AVX2" \
	"ATEN_CPU_CAPABILITY=default OPENBLAS_CORETYPE=Prescott MKL_CBWR=COMPATIBLE"
fit-paths: $(STAMP)
	tests=$$($(BIN)/python -c 'import sys; sys.path.insert(0, "benchmarks"); import gpu_campaign; \
		print(*gpu_campaign.CONVERGENCE_TESTS)') && \
	for settings in $(FIT_PATHS); do \
		echo "== $$settings"; env $$settings $(BIN)/python -m pytest -q -n $(CORES) -p no:cacheprovider $$tests || exit 1; \
	done

# The PyTorch range that pyproject.toml claims (torch>=2.8), checked by `make torch-range`, not by CI: each
# release in TORCH_VERSIONS gets a venv of its own under .venv-torch/ (git-ignored), named by interpreter and
# release, with that release from PyPI (for Linux the CUDA build, several GB a venv) and nbsim installed
# editable, and runs the kernel, compiled-kernel and golden-parity tests (docs/requirements.md). The default
# releases are the floor and the lent GPU machines' PyTorch; TORCH_RANGE_PYTHON=python3.12 matches their Python.
# The test tools are those of the test extra that these files use (not cctbx-base or nxmx: the DIALS tests').
TORCH_VERSIONS ?= 2.8.0 2.11.0
TORCH_RANGE_PYTHON ?= $(PYTHON)
TORCH_RANGE_TESTS ?= tests/test_kernel.py tests/test_compile.py tests/test_structure.py \
	tests/test_reference_intermediates.py tests/test_parity.py
TORCH_RANGE_TOOLS := "pytest>=8" "pytest-timeout>=2" "pytest-xdist>=3" "hypothesis>=6"
TORCH_RANGE_TAG = $(shell $(TORCH_RANGE_PYTHON) -c 'import sys; print("py%d.%d" % sys.version_info[:2])')
TORCH_RANGE_VENVS = $(foreach v,$(TORCH_VERSIONS),.venv-torch/$(TORCH_RANGE_TAG)-torch$(v))
torch_release = $(lastword $(subst -torch, ,$(1)))

# torch==<release> is asked for beside nbsim, so that nbsim's torch>=2.8 cannot move it; the check after the
# install fails where the venv holds another release all the same.
.venv-torch/%/.installed: pyproject.toml
	$(TORCH_RANGE_PYTHON) -m venv .venv-torch/$*
	.venv-torch/$*/bin/python -m pip install --quiet "torch==$(call torch_release,$*)" -e . \
		$(TORCH_RANGE_TOOLS)
	.venv-torch/$*/bin/python -c 'import sys, torch; v = torch.__version__.split("+")[0]; \
		sys.exit(None if v == "$(call torch_release,$*)" else f"torch {v} installed, not $(call torch_release,$*)")'
	touch $@

torch-range: $(addsuffix /.installed,$(TORCH_RANGE_VENVS))
	@failed=""; for venv in $(TORCH_RANGE_VENVS); do \
		echo "== $$venv: $$($$venv/bin/python -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')"; \
		$$venv/bin/python -m pytest -n $(CORES) --dist loadfile --no-loadscope-reorder $(TORCH_RANGE_TESTS) \
			|| failed="$$failed $$venv"; \
	done; \
	if [ -n "$$failed" ]; then echo "torch-range failed in:$$failed"; exit 1; fi

clean:
	rm -rf results .snakemake
