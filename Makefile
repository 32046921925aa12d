# ascend-finetune — every target creates the virtual environment itself when it is missing.
# Settings come from the environment or the command line (make train RECIPE=... OVERRIDES="...").
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHONPATH := $(CURDIR)
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup train plan preflight prepare-data selftest generate render export eval test test-fast test-durations bench-data image image-test clean

# MINDSPORE_WHEEL: the MindSpore wheel for this machine's architecture (file or URL; docs/container.md
# "MindSpore per architecture"): PyPI's mindspore 2.10.0 is x86-64 only. `setup` then checks that
# the installed MindSpore's native code matches this machine (python -m jobspec.native).
MINDSPORE_WHEEL ?=

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(MINDSPORE_WHEEL),"$(MINDSPORE_WHEEL)") -e '.[test]'
	@touch $@

setup: $(STAMP)
	$(PY) -m jobspec.native$(if $(MINDSPORE_WHEEL), || { $(PY) -m pip install -q --no-deps --force-reinstall \
	    "$(MINDSPORE_WHEEL)" && $(PY) -m jobspec.native; })

## The main job: with no NPU and no settings it runs recipes/tiny-cpu.yaml end to end.
train: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m launcher train

plan: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m launcher plan

preflight: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m launcher preflight

prepare-data: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m launcher prepare-data

## make selftest [ARGS="--quick"]: every fused op, the optimizer and the collectives on this host's devices
## against fp32 references (CPU: against the contract twins); a table and OUTPUT_DIR/selftest.json.
selftest: $(STAMP)
	set -f; PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m launcher selftest $$ARGS

## make generate PROMPT="Hello" [ARGS="--max-new-tokens 64"]: the fine-tuned model answers (ARGS=--base: the base model).
## PROMPT and ARGS reach the launcher as variables of the shell, never as shell text.
generate: $(STAMP)
	set -f; PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m launcher generate $${PROMPT:+--prompt "$$PROMPT"} $$ARGS

## make render [ARGS="volcano --nodes 2 --out job.yaml"]: a Kubernetes manifest for this job (default: volcano).
render: $(STAMP)
	set -f; PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m launcher render $${ARGS:-volcano}

## make export [CHECKPOINT=step_N] [ARGS="--dtype fp32"]: a Hugging Face directory from a saved checkpoint.
export: $(STAMP)
	set -f; PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m launcher export --checkpoint "$${CHECKPOINT:-latest}" $$ARGS

## make eval EVAL_DATA=/data/benchmarks [EVAL_TASKS=mmlu,gsm8k]: the base model and OUTPUT_DIR/hf on lm-eval's
## tasks, side by side, into OUTPUT_DIR/eval (docs/evaluation.md).
eval: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m launcher eval

test: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q $(PYTEST_ARGS) tests

## make test timed: the 40 slowest tests and the total rewritten into docs/tests.md (tools/test_durations.py).
test-durations: $(STAMP)
	@mkdir -p build; start=$$(date +%s); \
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q --junitxml=build/test-durations.xml $(PYTEST_ARGS) tests; \
	rc=$$?; $(PY) tools/test_durations.py build/test-durations.xml --wall $$(( $$(date +%s) - start )) \
	    --write docs/tests.md; exit $$rc

## Everything but the multi-process tests (msrun, faults, image): the quick loop while working.
test-fast: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

## ruff (lint + import order) and mypy (strict on jobspec/), configured in pyproject.toml; CI runs it.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench-data: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/bench_data.py

## Our training step vs transformers + torch eager (docs/speed.md); TORCH_PYTHON: an interpreter with both.
TORCH_PYTHON ?= $(CURDIR)/$(PY)
## BENCH_ARGS e.g. "--rounds 6 --json bench.json" or "--paths ours-opbyop"; METHOD=lora: our LoRA step against
## our full step and transformers + peft (TORCH_PYTHON then needs peft too).
METHOD ?= full
.PHONY: bench-train bench-dp profile-step
bench-train: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/bench_train.py --torch-python "$(TORCH_PYTHON)" --method "$(METHOD)" $(BENCH_ARGS)

## Multiple-choice scoring: our evaluator against lm-eval's hf model on the same files (TORCH_PYTHON: torch + lm-eval).
.PHONY: bench-eval
bench-eval: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/bench_eval.py --torch-python "$(TORCH_PYTHON)" $(BENCH_ARGS)

## DP 2 (one worker per core) against one process on both cores, through the launcher (docs/speed.md).
bench-dp: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/bench_dp.py $(BENCH_ARGS)

## The memory estimate against the measured peak RSS over a grid of short CPU runs (docs/memory.md);
## BENCH_ARGS e.g. "--rows h256-ga1,h256-ga4 --json mem.json".
## ZeRO-3's memory saving at DP 2 against ZeRO-1 alone (issue 33 item 4; make test runs it too: docs/distributed.md, ZeRO-3).
.PHONY: bench-zero3-memory
bench-zero3-memory: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -s -k test_zero3_peak_is_below_zero1 tests/finetune/dist/test_zero3_msrun.py

.PHONY: bench-memory
bench-memory: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/bench_memory.py $(BENCH_ARGS)

## What a compiled decoder layer holds beyond op by op on CPU, per layer, and the fit behind the estimate's
## `graphs` term (docs/memory.md); BENCH_ARGS e.g. "--json graphs.json".
.PHONY: bench-graphs
bench-graphs: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/bench_graphs.py $(BENCH_ARGS)

## Per-phase and per-op times of one step, ours against torch at the bench shape (docs/speed.md).
profile-step: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tools/profile_step.py --torch-python "$(TORCH_PYTHON)" $(PROFILE_ARGS)

clean:
	rm -rf output build .pytest_cache

## Container image (docs/container.md). `make image` uses docker when an engine answers, else buildah.
IMAGE ?= ascend-finetune:latest
BASE_IMAGE ?=
PIP_CA ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
.PHONY: base-image

image:
	IMAGE="$(IMAGE)" BASE_IMAGE="$(BASE_IMAGE)" PIP_CA="$(PIP_CA)" MINDSPORE_WHEEL="$(MINDSPORE_WHEEL)" \
	    tools/image/build.sh

## Local CANN-shaped base (Debian bookworm via debootstrap, cached under /var/tmp; Python only under
## /usr/local/python3.11.x; stub CANN set_env.sh scripts) in buildah storage.
base-image:
	tools/image/base.sh

## Build on the CANN-shaped base with buildah and run the entrypoint inside: bash, plan, training end to end.
image-test: $(STAMP)
	tools/image/test.sh "$(CURDIR)/$(PY)"
