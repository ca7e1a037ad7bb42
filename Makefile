# minite — every target sets itself up: `make train` and `make test` work on a fresh Linux machine.
#
#   make setup       create .venv (torch==2.13.0, triton==3.7.1 pinned; minite editable with [dev])
#   make train       train the GPT on the default corpus (CPU preset unless CUDA is present)
#   make test        the whole suite: library tests (Triton under TRITON_INTERPRET=1 on CPU), notebooks, grading,
#                    then the sm_90/sm_80 compile gate over every kernel launch the suite made
#   make check-fast  ruff (notebooks' .py too), notebook checks (copied answers, jupytext pairs in sync, exercises
#                    without outputs and in sync with solutions), line budgets (< 60 s)
#   make lab         JupyterLab on the course (notebooks/, exercises/); jupytext saves both files of a pair
#   make exercises   regenerate exercises/NN_topic_exercise.ipynb from solutions/NN_topic.ipynb (an exercise with
#                    edits is kept and named, never overwritten: ARGS=--force replaces it)
#   make grade NB=exercises/00_triton_from_zero_exercise.ipynb [TIMEOUT=300] [REPORT=path.json] [CSV=path.csv]
#                    [SOLUTION=...]   score a notebook: points per task and the total (REPORT: JSON, CSV: a row per task)
#   make check NB=exercises/00_triton_from_zero_exercise.ipynb    self-check: the notebook's own check cells (not a grade)
#   make bundle      dist/minite-course.zip: the course for learners, without solutions/ (and tests/)
#   make bench       every benchmark: kernel ones need CUDA (they say so and exit on CPU); bench_train also runs on CPU
#   make scale       chapter 14: each parallel/recompute technique vs its baseline on the CPU (memory, bytes, time)
#   make gpu-report [OUT=DIR]   on one GPU, <= 9 min, no network: the main job, the suite on CUDA, every benchmark
#                    beside its peers; summary.md + one .tgz into OUT (on a CPU: says so, lists its stages)

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.minite-setup
UNAME := $(shell uname -s)
# Pinned (the course's tested versions). tools/install_torch.py gets torch's CPU build from PyTorch's CPU index on a
# machine without an NVIDIA driver (PyPI's Linux torch is the multi-GB CUDA build). Triton ships Linux wheels only.
TORCH_PIN := torch==2.13.0
TRITON_PIN := $(if $(filter Linux,$(UNAME)),triton==3.7.1,)
NPROC := $(shell nproc 2>/dev/null || echo 2)
# Library tests + notebooks, spread over the cores; notebooks stay whole per worker (--dist loadfile).
PYTEST_JOBS ?= $(NPROC)

.PHONY: notebooks setup train test test-lib test-notebooks check-fast lab exercises grade check bundle bench scale \
	gpu-report clean-venv

$(STAMP): pyproject.toml Makefile
	@echo "== setting up $(VENV) (once; re-run when pyproject.toml or the Makefile change) =="
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) tools/install_torch.py $(TORCH_PIN) $(TRITON_PIN)  # CPU build where there is no NVIDIA driver
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (minite)" >/dev/null
	$(PY) -c "import matplotlib.pyplot"   # warm the font cache once, not inside a timed notebook
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(PY) -m minite.train $(ARGS)

# One OpenMP thread per process: pytest-xdist already runs one worker (and its notebook kernels) per core.
# Then the sm_90/sm_80 compile gate: every distinct kernel launch the suite made under the interpreter, compiled
# for the GPU (minite/gpu_compile.py), with the launches a GPU makes at the benchmarks' shapes (minite/gpu_examples.py:
# its tiles must reach wgmma, not replicate, not spill); on a CUDA machine nothing is recorded and the gate says so.
LAUNCHES := $(CURDIR)/.launches
# A learner's bundle (make bundle) carries this marker: test, check-fast and grade then work without solutions/.
BUNDLE := $(wildcard .learner-bundle)
ifeq ($(BUNDLE),)
test: $(STAMP)
	rm -rf $(LAUNCHES)
	OMP_NUM_THREADS=1 MINITE_RECORD_LAUNCHES=$(LAUNCHES) $(PY) -m pytest -n $(PYTEST_JOBS) --dist loadfile \
		-p no:cacheprovider tests notebooks --nbval-lax --nbval-current-env --nbval-cell-timeout=600 \
		--durations=15 $(ARGS)
	env -u TRITON_INTERPRET $(PY) -m minite.gpu_compile $(LAUNCHES) --examples --jobs $(PYTEST_JOBS) \
		$(if $(ARGS),,--require-all)
else
test: $(STAMP)  # a learner's bundle (tools/bundle.py): no tests/ here; the lessons, and every exercise failing
	# only at its stubs (exercises/test_exercises.py: a blank task's NotImplementedError and the checks after it)
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(PYTEST_JOBS) --dist loadfile -p no:cacheprovider notebooks \
		exercises/test_exercises.py --nbval-lax --nbval-current-env --nbval-cell-timeout=600 $(ARGS)
endif

test-lib: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_JOBS) --dist loadfile tests $(ARGS)

test-notebooks: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_JOBS) --dist loadfile notebooks --nbval-lax --nbval-current-env $(ARGS)

check-fast: $(STAMP)
ifeq ($(BUNDLE),)
	$(PY) -m ruff check minite tests tools benchmarks notebooks solutions
	$(PY) tools/check_notebooks.py
else
	$(PY) -m ruff check minite tools benchmarks notebooks
endif
	$(PY) tools/budgets.py

# Rooted at the repository so exercises/ is reachable and jupytext.toml applies; the jupytext server extension
# (installed with jupytext) makes every save write both the .ipynb and its paired .py.
# A lesson saved with no cell changed is written back as it was (tools/lab_hooks.py: running a lesson leaves git
# clean; `python -m` puts the repository first on the server's path for it, not the kernels').
# As root (a Docker image) Jupyter needs --allow-root; the "get Jupyter news?" toast is answered "never" once (it
# covered the lesson); ARGS go to jupyter lab (make lab ARGS="--port 8889 --no-browser").
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.json
lab: $(STAMP)
	@$(VENV)/bin/jupyter server extension list 2>&1 | grep -q "jupyterlab_jupytext.*enabled" || \
		$(VENV)/bin/jupyter server extension enable --sys-prefix jupyterlab_jupytext
	@test -f $(LAB_SETTINGS) || { mkdir -p $(dir $(LAB_SETTINGS)) && echo \
		'{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}' \
		> $(LAB_SETTINGS); }
	$(PY) -m jupyterlab --ServerApp.root_dir="$(CURDIR)" $(if $(filter 0,$(shell id -u)),--allow-root,) \
		--ContentsManager.pre_save_hook=tools.lab_hooks.keep_lesson_outputs $(ARGS) notebooks/00_triton_from_zero.ipynb

# Re-create each NB's .ipynb from its jupytext .py and execute it: make notebooks NB="notebooks/03_rmsnorm.py"
notebooks: $(STAMP)
	@test -n "$(NB)" || { echo 'usage: make notebooks NB="notebooks/NN_topic.py [solutions/NN_topic.py ...]"'; exit 2; }
	$(PY) tools/nbtool.py execute $(NB)

ifeq ($(BUNDLE),)
exercises: $(STAMP)
	$(PY) -m minite.grading generate $(ARGS)
else
exercises:  # the instructor's targets: they need solutions/ and tools/, which a learner's bundle leaves out
	@echo "make exercises regenerates exercises/ from solutions/: the course repository has them, this bundle does not"; exit 2
endif

grade: $(STAMP)
	@test -n "$(NB)" || { echo "usage: make grade NB=exercises/00_triton_from_zero_exercise.ipynb"; exit 2; }
ifeq ($(BUNDLE),)
	$(PY) -I -m minite.grading grade $(NB) $(if $(TIMEOUT),--timeout $(TIMEOUT),) $(if $(REPORT),--report $(REPORT),) \
		$(if $(CSV),--csv $(CSV),) $(if $(SOLUTION),--solution $(SOLUTION),)
else
	@echo "a learner's bundle holds no solutions/: this is a self-check of the notebook's own check cells, not a grade"
	$(PY) -m minite.grading selfcheck $(NB) $(if $(TIMEOUT),--timeout $(TIMEOUT),)
endif

# A self-check: run a notebook and report its own check cells (no solutions/ needed; says it is not a grade)
check: $(STAMP)
	@test -n "$(NB)" || { echo "usage: make check NB=exercises/00_triton_from_zero_exercise.ipynb"; exit 2; }
	$(PY) -m minite.grading selfcheck $(NB) $(if $(TIMEOUT),--timeout $(TIMEOUT),)

ifeq ($(BUNDLE),)
bundle:
	$(PYTHON) tools/bundle.py
else
bundle:
	@echo "make bundle builds this zip from the course repository; this is already a learner's bundle"; exit 2
endif

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b $(ARGS) || exit 1; done

# Chapter 14: memory per rank, bytes sent, step time and loss curve of every layout on the CPU (~4 min on 2 cores)
scale: $(STAMP)
	$(PY) benchmarks/bench_scale.py $(ARGS)

# The GPU machine is bare (torch and triton preinstalled, no network): no .venv, no set-up; its own python3 runs
# the report, which installs nothing from the network (benchmarks/gpu_report.py --list: the stages and limits).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-report:
	$(GPU_PY) benchmarks/gpu_report.py $(if $(OUT),--out $(OUT),)

clean-venv:
	rm -rf $(VENV)
