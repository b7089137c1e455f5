# Tandem: every target sets itself up; all are idempotent.
SHELL   := /bin/bash
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PROTOS  := $(wildcard proto/tandem/v1/*.proto)
GEN     := proto/tandem/v1/.generated
export UCX_NET_DEVICES ?= lo
export UCX_WARN_UNUSED_ENV_VARS ?= n
export RAY_AUTH_MODE ?= disabled

.PHONY: setup run test test-unit proto bench bench-al soak lint clean observe bench-agentic bench-serve

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	set -o pipefail; $(BIN)/python -m pip install -q -e '.[test]' 2>&1 | { grep -v '^WARNING: Location' || true; }
	$(BIN)/python -c "import torch, grpc, ucxx, ray, prometheus_client, hypothesis; print('setup ok: torch', torch.__version__)"
	deploy/prometheus/install.sh || echo "setup: no prometheus server; its live test will be skipped"
	touch $(STAMP)

proto: $(STAMP) $(GEN)

$(GEN): $(PROTOS) $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)
	touch $@

run: proto
	$(BIN)/tandem up

# the local cluster plus a Prometheus server scraping it (OBSERVE_ARGS: `tandem up` options)
observe: proto
	deploy/prometheus/install.sh
	$(BIN)/python -m deploy.prometheus.observe $(OBSERVE_ARGS)

# lint first: a broken layer contract or unformatted file fails the tests
test: proto lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# the inner loop: everything but the end-to-end runs marked slow
test-unit: proto
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: proto
	$(BIN)/python -m bench.kvcore
	$(BIN)/python -m bench.ucx_raw
	$(BIN)/python -m bench.transfer
	$(BIN)/python -m bench.host_step

# acceptance length, aggregated vs disaggregated unified vs separate (minutes on CPU, to 8K
# tokens); on a GPU to 32K: LADDER_ARGS / AL_ARGS, e.g. AL_ARGS="--device cuda --lengths 1024
# 2048 4096 8192 16384 32000" (docs/performance.md has the commands of the recorded runs)
bench-al: proto
	$(BIN)/python -m bench.al_ladder $(LADDER_ARGS)
	$(BIN)/python -m bench.disagg_al $(AL_ARGS)

# agentic multi-turn replay: unified vs separate, with and without the host KV tier
# (about 5 minutes on 2 CPU cores; AGENTIC_ARGS to scale, e.g. --conversations 16 --concurrency 8)
bench-agentic: proto
	$(BIN)/python -m bench.agentic $(AGENTIC_ARGS)

# 64 concurrent streams with random cancellations for 10 minutes (SOAK_ARGS to change)
soak: proto
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

# aiperf (in its own .venv-aiperf) against a local cluster's OpenAI endpoint; prints its table.
# SERVE_ARGS="sweep ..." runs the served-load sweep instead (bench/serve_sweep.py; on a GPU:
# SERVE_ARGS="sweep --model DIR/target --drafter DIR/drafter", DIR from bench.random_model)
bench-serve: proto
	$(BIN)/python -m bench.serve $(SERVE_ARGS)

# ruff over the whole tree (kvcore, tokenization, services, deploy, models, bench, tests),
# then the layer contracts of pyproject.toml's [tool.importlinter]
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) proto/tandem/v1/*_pb2*.py* .pytest_cache .ruff_cache .import_linter_cache
