# Each target bootstraps .venv on a fresh machine that has only Python.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch, installed first so that the project's torch range is already met
# and pip does not pull a multi-GB CUDA build. Override on a GPU machine: make TORCH=torch
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.bench-installed
BROWSER_STAMP := $(VENV)/.browser-checked
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (first run only)..."
	@$(PIP) install "$(TORCH)" 2>&1 | grep -v "^WARNING: Location" || true
	@$(PIP) install -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
	@# The grammar extra without triton (xgrammar needs it only for GPU kernels; ~1 GB on disk)
	@$(PIP) install apache-tvm-ffi pydantic 2>&1 | grep -v "^WARNING: Location" || true
	@$(PIP) install --no-deps "xgrammar>=0.1.25" 2>&1 | grep -v "^WARNING: Location" || true
	@$(BIN)/python -c "import omni, torch, trio, zmq, msgspec, cryptography, pytest_trio, xdist, xgrammar" || \
		{ echo "install failed: see the pip output above"; exit 1; }
	@touch $(STAMP)

DEMO_OUT ?= $(or $(TMPDIR),/tmp)/omni-demo

demo: $(STAMP)
	$(BIN)/omni run examples/hello.py --input text="omni runs pipelines"
	@mkdir -p $(DEMO_OUT)
	OMNI_DIALOGUE_OUT=$(DEMO_OUT) $(BIN)/omni run examples/omni_dialogue.py \
		--inputs-json examples/dialogue_turns.jsonl --json
	@echo "the replies' speech is in $(DEMO_OUT)"
	@echo "omni is installed in $(VENV): '. $(VENV)/bin/activate' puts it on your PATH"

# Debian's chromium and its driver, for the playground's browser test (which says why it is
# skipped where they cannot be installed: not root, no apt).
$(BROWSER_STAMP):
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium for the browser test (first run only)..."; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && \
		  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
		echo "could not install chromium: the browser test will be skipped"; \
	else echo "no chromium (and not root with apt): the browser test will be skipped"; fi
	@touch $@

# The suite on parallel workers (each test isolated: its own tmp dirs, shared-memory and socket
# folders, ports the OS picks); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 4

test: $(STAMP) $(BROWSER_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

BENCHMARKS := scheduler cli_output kv prefix_reuse decode diffusion_reuse footprint transport cluster payloads soak serve tenants stop_window cpu_linear omni_model image_model ray_cluster

# The benchmarks' own extra (their baselines: Ray, transformers serve), on top of the dev install.
$(BENCH_STAMP): $(STAMP)
	@$(PIP) install -e ".[dev,bench]" 2>&1 | grep -v "^WARNING: Location" || true
	@$(BIN)/python -c "import ray, uvicorn" || { echo "install failed: see the pip output above"; exit 1; }
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	@start=$$(date +%s); \
	for b in $(BENCHMARKS); do \
		echo "== perf/$$b.py"; \
		t=$$(date +%s); \
		$(BIN)/python perf/$$b.py --out perf/results/$$b.json --plot perf/results/$$b.png \
			> /dev/null || exit 1; \
		echo "   $$(( $$(date +%s) - t )) s"; \
	done; \
	echo "== perf/report.py"; \
	$(BIN)/python perf/report.py || exit 1; \
	echo "results in perf/results/, report in perf/REPORT.md, table in README.md"; \
	echo "make bench: $$(( $$(date +%s) - start )) s in all"

lint: $(STAMP)
	$(BIN)/ruff check omni cli tests perf examples

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
