# PagedWeight: `make demo` runs the main job on the bundled model, `make test` runs lint, types and tests.
# Both create .venv and install what they need on first use (torch==2.13.0 from pip's configured index: README).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The history of the city begins
# Whole-process memory budget of the serving demo: tight enough that the planner trades expert bits for KV.
DEMO_BUDGET ?= 48MiB

.PHONY: setup demo eval eval-suite192 test test-slow gpu-test lint typecheck unit clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV): torch==2.13.0 and the project's dependencies (about 3 GB on disk; a few minutes)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: setup
	mkdir -p artifacts/runs
	$(BIN)/pwcal inspect artifacts/models/tiny-qwen2moe-wiki
	$(BIN)/pwrun generate --prompt "$(PROMPT)" --max-new-tokens 60
	$(BIN)/pwrun generate --prompt "$(PROMPT)" --max-new-tokens 60 --temperature 0.8 --top-p 0.95 --seed 1
	$(BIN)/pwrun ppl --dataset wikitext2 --max-windows 64
	$(BIN)/pwcal run-all artifacts/models/tiny-qwen2moe-wiki --out artifacts/runs/tiny-ap
	$(BIN)/pwrun ppl --dataset wikitext2 --max-windows 64 --artifacts artifacts/runs/tiny-ap --uniform-bits 4
	$(BIN)/pwrun ppl --dataset wikitext2 --max-windows 64 --artifacts artifacts/runs/tiny-ap --uniform-bits 3
	$(BIN)/pwrun prompts --dataset c4 --count 24 --out artifacts/runs/demo_prompts.jsonl
	$(BIN)/pwrun generate --prompts artifacts/runs/demo_prompts.jsonl --artifacts artifacts/runs/tiny-ap \
		--gpu-memory $(DEMO_BUDGET) --max-new-tokens 64 --output artifacts/runs/demo_outputs.jsonl \
		--trace artifacts/runs/demo_trace.parquet --summary-json artifacts/runs/demo_summary.json

# The whole evaluation: every policy x budget on both suites -> docs/eval/results.parquet, the figures
# and markdown tables, then the analysis notebooks' figures. One thread per process: the cores are often shared.
eval: setup
	mkdir -p artifacts/runs
	$(BIN)/pwcal run-all artifacts/models/tiny-qwen2moe-wiki --out artifacts/runs/tiny-ap --residual-heads
	OMP_NUM_THREADS=1 $(BIN)/pwrun eval sweep --out docs/eval --artifacts artifacts/runs/tiny-ap \
		--oracle docs/eval/oracle/damage_kmeans.parquet
	$(BIN)/pwrun eval notebooks --artifacts artifacts/runs/tiny-ap --figures docs/eval
	$(MAKE) eval-suite192

# Target (a) on 4x the text suite (192 windows per text): the 48-window suite's noise (+-0.5%) is as wide as its
# "within 0.5% of the oracle"; about 18 minutes on one core. Needs artifacts/runs/tiny-ap (make eval makes it).
SUITE192 = docs/eval/oracle/suite192
RUN192 = OMP_NUM_THREADS=1 $(BIN)/pwrun eval run --out $(SUITE192)/results.parquet --requests 192 --threads 1 \
	--artifacts artifacts/runs/tiny-ap
eval-suite192: setup
	rm -f $(SUITE192)/results.parquet
	$(RUN192) --gpu-memory U3,U3.5,U4,U4.25,U4.375,U4.5,U4.625,U4.75,U5
	$(RUN192) --policy 16-bit
	$(RUN192) --policy static --damage docs/eval/oracle/damage_kmeans.parquet \
		--gpu-memory U3,U3.25,U3.5,U4,U4.25,U4.375,U4.5,U4.625,U4.75,U5
	$(BIN)/pwrun eval report --results $(SUITE192)/results.parquet --out artifacts/runs/suite192-report
	cp artifacts/runs/suite192-report/targets.md $(SUITE192)/targets.md

lint: setup
	$(BIN)/ruff check pwformat pwrun pwcal pweval pwkernels tests tools bench

typecheck: setup
	$(BIN)/mypy

# TEST_WORKERS pytest-xdist processes of one thread each (a test's interpreted Triton kernels use one core; several
# threads per worker on shared cores spin against each other).
TEST_WORKERS ?= 2
unit: setup
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal

test: lint typecheck unit

# The whole-model quality studies that `make test` leaves out (pytest marker `slow`; about 10 minutes on 2 cores).
test-slow: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m slow

# On a GPU machine whose python3 already has torch, triton and the project's dependencies (no venv, no network;
# an existing PYTHONPATH, e.g. a folder of extra wheels, is kept): every test with a CUDA path, natively, on
# GPU_TEST_WORKERS pytest-xdist workers sharing the GPU (most of the time is Triton compiling the odd test shapes).
# Refuses to run without a GPU rather than skip everything. One line per test as it ends (-vv beats addopts' -q), so
# a failure or a test that hangs is named even when a time limit cuts the session before its summary.
GPU_TEST_WORKERS ?= 12
gpu-test:
	$(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make gpu-test needs a CUDA GPU')"
	HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PYTHON) -m pytest -m gpu -vv -rfEs -n $(GPU_TEST_WORKERS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
