# Every target sets itself up: a .venv is (re)built when missing or older than pyproject.toml.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# On a GPU cluster install the torch build you want into .venv first, or run e.g. `make TORCH="torch==2.13.0" test`.
# Here torch 2.13.0 (CPU) installs offline; a bare `torch` would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

# The lessons' save hook (toolkit_lessons/, a server extension) for every Jupyter server of this environment (an editable
# install skips pyproject's data-files, so it is copied here).
LESSONS_HOOK := etc/jupyter/jupyter_server_config.d/toolkit-lessons.json
# The browser tests drive Debian's chromium through Playwright (Playwright's own browser download is not
# used); set CHROMIUM=/path/to/chrome to use another.
CHROMIUM ?= $(shell command -v chromium chromium-browser google-chrome 2>/dev/null | head -n1)
export CHROMIUM
# JupyterLab refuses to start as root (containers, course VMs) unless told it may.
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup demo compare lint test test-times test-browser test-papers test-grading test-mutants test-models test-large-world test-stress test-gpu lab notebooks browser clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile jupyter-config/jupyter_server_config.d/toolkit-lessons.json
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	@$(PY) -m pip uninstall -q -y toolkit 2>/dev/null || true  # this project's distribution before it was renamed
	$(PY) -m pip install -q -e ".[dev,hf]"
	install -D -m 644 jupyter-config/jupyter_server_config.d/toolkit-lessons.json $(VENV)/$(LESSONS_HOOK)
	@$(MAKE) --no-print-directory browser
	@touch $(STAMP)

# Debian's chromium where it is missing and can be installed (root and apt-get); otherwise say what to do.
browser:
	@if [ -n "$(CHROMIUM)" ]; then echo "browser tests use $(CHROMIUM)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null && \
	  echo "installed Debian's chromium for the browser tests"; \
	else echo "WARNING: no Chromium found and none can be installed here (not root, or no apt-get): the browser"\
	  "tests will fail. Install chromium, or set CHROMIUM=/path/to/chrome."; fi

demo: $(STAMP)
	$(PY) -m toolkit demo

# ruff (pinned in the dev extras; rules and line length in pyproject.toml): the lint, then the formatter as a check
# (nothing is rewritten: `.venv/bin/ruff check --fix` and `.venv/bin/ruff format` do that). Both run, whatever the
# first finds; the target fails when either does.
lint: $(STAMP)
	@status=0; \
	echo "$(VENV)/bin/ruff check ."; $(VENV)/bin/ruff check . || status=1; \
	echo "$(VENV)/bin/ruff format --check ."; $(VENV)/bin/ruff format --check . || status=1; \
	exit $$status

# Two workers (pytest-xdist), each test file whole on one: a test mostly waits for the ranks it starts, their
# messages and its subprocesses, so one worker leaves the cores half idle (on 2 cores: 12.4 min against 20.2).
# The 25 slowest tests are listed at the end (where the time goes). A bare `pytest` runs the suite in one process.
test: $(STAMP) browser
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

# Where the suite's time goes: make test, with each test's wall and CPU seconds (its own and its processes'; as root,
# every process it started, the zygote's ranks too: cpu_tree_s) in runs/test-times.tsv, most CPU first (CPU is what
# a test costs; wall says how busy the machine was).
test-times: $(STAMP) browser
	TOOLKIT_TEST_TIMES=runs/test-times.tsv $(PY) -m pytest -q --durations=30

# Beyond the suite's time budget: grading at scale (misbehaving solutions, a class folder, every attack on the grader,
# every lab against the students' wheel): a grading or more per test, up to a minute each on 2 loaded cores.
test-grading: $(STAMP)
	$(PY) -m pytest -q -m grading_scale

# Every lab's reference mutated (off-by-one indices, wrong reduce ops, missing waits, ...) and graded by its visible and
# hidden checks: fails when a lab kills under 90% of its mutants or a survivor is not explained (labs/README.md).
# 668 mutants over 13 labs: about 30 min on 2 cores shared with other work; it writes the table into labs/README.md.
test-mutants: $(STAMP)
	$(PY) -m toolkit.grading.mutants labs/ --write --check

test-papers: $(STAMP)
	$(PY) -m pytest -q -m papers

# Hugging Face models as they come (GPT-2, Llama, Mixtral, Qwen2-MoE, BERT, ViT) through every strategy, tp, pp, ep,
# their compositions and 3D against plain torch, and simulated at 512 ranks: 8 CPU-minutes (14 min on 2 loaded cores).
test-models: $(STAMP)
	$(PY) -m pytest -q -n 2 -m models tests/test_hf_models.py

# Layouts of 8 ranks (dp x pp x cp x tp, both rank orders, checkpoints between them): 8 processes on 2 cores.
test-large-world: $(STAMP)
	$(PY) -m pytest -q -m large_world

# The whole browser set: every lesson run in JupyterLab, its widgets exercised (make test runs a smaller set).
test-browser: $(STAMP) browser
	TOOLKIT_BROWSER_LESSONS=all $(PY) -m pytest -q -m browser tests/test_browser.py

# The tests that start processes, while other processes burn every core, three rounds that must all be green
# (not in make test: it takes several times the suite's time on purpose). tests/stress.py --help for options.
test-stress: $(STAMP) browser
	$(PY) tests/stress.py --rounds 3

# The GPU path (NCCL, CUDA memory and events, the simulator against this GPU, torch DDP/FSDP2 beside):
# where CUDA exists it prints tables for docs/benchmarks.md; elsewhere it says it skipped, and exits 0.
# Where python3 already holds a CUDA build of torch and no package index can be reached (a lent GPU machine),
# `make test-gpu PY=python3` runs it with that python and builds no .venv (the toolkit imports torch, numpy, tqdm,
# tabulate, cloudpickle and sympy).
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PY) bench/gpu_suite.py
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PY) bench/kernel_profile.py

lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(LAB_ROOT) notebooks/

notebooks: $(STAMP)
	$(VENV)/bin/jupytext --sync notebooks/*.py

clean:
	rm -rf $(VENV) runs .pytest_cache
