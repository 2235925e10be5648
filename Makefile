# `make train` runs the main job, `make test` the test suite (`make test-harness` the study
# harness's slow tests); each creates .venv on first use.
# `make floors` runs a smoke subset of the tests in a new .venv-floor holding the oldest
# versions pyproject.toml allows (requirements-floor.txt); `make wheel-check` installs a wheel
# of the repo into a new environment outside it and runs the README's examples there.
PYTHON ?= python3
VENV := .venv
FLOOR_VENV := .venv-floor
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-harness lint bench floors wheel-check docs clean device-check

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m pdasgd_jax train --algo sgd --dataset digits --out runs/quickstart --overwrite

# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file in one of them so its
# module fixtures are built once; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

# The study harness's slow tests (marked `harness`), which `make test` leaves out.
test-harness: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m harness

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Optimizers (shard_map included), kernels of a plain and a batchnorm model, the simulator,
# an SPMD program, the threaded runtime and the README's examples.
SMOKE := tests/test_optim.py \
	tests/test_executor.py::test_sequential_jobs_equal_plain_sgd \
	"tests/test_models.py::test_stage_kernels_match_whole_model_autodiff[mlp]" \
	"tests/test_models.py::test_stage_kernels_match_whole_model_autodiff[cnn-bn-8x8]" \
	tests/test_simulate.py::test_one_device_without_delays_is_plain_sgd \
	tests/test_simulate.py::test_sync_is_real_sync_and_waits_for_the_slowest \
	"tests/test_dasgd.py::test_vmap_on_one_device_equals_shard_map_over_the_mesh[8-8]" \
	tests/test_runtime.py::test_runtime_trains_to_its_budget_and_reports \
	tests/test_readme.py

# The old versions' warnings about newer APIs' deprecations are not failures here (`make test`
# still turns every warning into an error, on the pinned versions).
floors:
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install -q -c requirements-floor.txt -e . scikit-learn pytest pytest-timeout
	$(FLOOR_VENV)/bin/python -m pip list 2>/dev/null | grep -iE "^(jax|jaxlib|flax|optax|numpy|scikit-learn) "
	$(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning $(SMOKE)

wheel-check: $(STAMP)
	$(PY) scripts/check_wheel.py

# On a machine with a GPU or TPU: tests on the device, bench mfu, runtime throughput against the
# fused loop and the simulator's prediction of the runtime, in at most 8 minutes, into
# bench_results/device_check/<UTC date and time>/ (device_check.json and device_check.md). Where
# .venv cannot be built, the machine's own Python runs it: python3 scripts/device_check.py --out DIR.
DEVICE_CHECK_OUT ?= bench_results/device_check/$(shell date -u +%Y-%m-%d-%H%M)

device-check: $(STAMP)
	$(PY) scripts/device_check.py --out $(DEVICE_CHECK_OUT)

# The documentation site (mkdocs.yml) into site/, every warning an error; its tools are pinned
# in requirements-docs.txt and installed into .venv beside the library's.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP) requirements-docs.txt
	$(PY) -m pip install -q -r requirements-docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) scripts/make_cli_reference.py --check
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(FLOOR_VENV) runs site
