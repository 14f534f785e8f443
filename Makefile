# Two commands do everything on a fresh machine (Python 3.11): `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# Python images often set PYTHONDONTWRITEBYTECODE=1; uv installs no bytecode, so with it every
# Python process compiles what it imports from source again (`import prefect` 2.8 CPU-s against
# 1.3 cached, a Ray head 17.5 CPU-s to start against 6.5, each Ray job 0.42 against 0.20). Our
# commands let Python keep the bytecode it compiles: in the virtualenvs and __pycache__/ (ignored).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-core
# The second environment: every extra (nemo-run pins leptonai, which drags Prefect down to 3.5).
NR_VENV := .venv-nemo-run
NR_BIN := $(NR_VENV)/bin
NR_STAMP := $(NR_VENV)/.installed-nemo-run
# The peers' environment (`make bench-peers` only): dagster-ray (newest on PyPI when pinned)
# apart from ours, with Ray and httpx at the versions of constraints/core.txt, so its client
# matches the cluster. Not all of core.txt: dagster pins watchdog below the version it holds.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed-peers
PEERS_PINS := dagster-ray==0.4.8 dagster==1.13.29 \
	$(shell sed -n -e 's/^ray==/ray[default]==/p' -e '/^httpx==/p' constraints/core.txt)

.PHONY: demo test test-core test-extras test-fast bench bench-scale bench-peers chaos lint docs \
	install system clean control-plane

# The virtualenv, installed with the pinned versions of constraints/core.txt by uv (pip's resolver
# and byte-compiling took ~45 s of the 2-core CI budget; uv installs the same set in ~8 s).
$(STAMP): pyproject.toml constraints/core.txt
	@test -n "$(PYTHON)" || { echo "need Python 3.11 (python3.11 or python3 on PATH)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints/core.txt uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -c constraints/core.txt -e '.[test]'
	touch $(STAMP)

$(PEERS_STAMP): Makefile constraints/core.txt
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet -c constraints/core.txt uv
	$(PEERS_VENV)/bin/uv pip install --quiet --python $(PEERS_VENV)/bin/python \
		$(foreach pin,$(PEERS_PINS),'$(pin)')
	touch $(PEERS_STAMP)

$(NR_STAMP): pyproject.toml constraints/nemo-run.txt
	test -x $(NR_BIN)/python || $(PYTHON) -m venv $(NR_VENV)
	$(NR_BIN)/python -m pip install --quiet -c constraints/nemo-run.txt uv
	$(NR_BIN)/uv pip install --quiet --python $(NR_BIN)/python -c constraints/nemo-run.txt \
		-e '.[nemo-run,lightning,test]'
	touch $(NR_STAMP)

## Both virtualenvs, side by side.
install:
	@$(MAKE) --no-print-directory -j2 $(STAMP) $(NR_STAMP)

## Debian packages and services the real-engine tests need (Slurm + sshd, Chromium); as root.
system:
	scripts/install-system-packages

## Run the demo pipeline on an embedded local Ray cluster; the runs stay visible in the Prefect UI.
demo: $(STAMP)
	$(BIN)/prefect-nemo demo

## Install, lint and test, printing each phase's time: the whole suite in the core environment
## (newest Prefect), then in the extras environment (Prefect 3.5) what needs the extras plus
## the Prefect 3.5 smoke of the core (tests marked `compat`, chosen in tests/conftest.py).
test:
	@MAKE="$(MAKE)" scripts/timed-phases install system lint docs control-plane test-core test-extras

# --durations: CI's log names the slowest tests of each phase (the budget is 20 minutes in all).
# WORKERS workers, each taking whole files: most real-engine tests wait on a cluster, not on a
# core (two workers kept the 2 cores ~60 % busy).
WORKERS ?= 4
PYTEST_WORKERS := -n $(WORKERS) --dist loadfile
test-core: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 $(PYTEST_WORKERS) -m "not nemo_run"

test-extras: $(NR_STAMP)
	$(NR_BIN)/python -m pytest -q --durations=15 $(PYTEST_WORKERS) -m "nemo_run or compat"

## The quick subset: no cluster, no server.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not nemo_run"

## Reliability under chaos at issue 17's sizes (kill -9 + sweeper, Ray dashboard down, flow-run
## cancel, Prefect server down 90 s) on a real Prefect server and local Ray; key=value lines.
chaos: $(STAMP)
	$(BIN)/python -m bench.chaos

## The real Kubernetes control plane (kube-apiserver, kube-controller-manager, etcd, the KubeRay
## operator) built from Go modules into ~/.cache/prefect-nemo/control-plane once (prints the cold
## build time); `make control-plane CP=up` starts it in the background, `CP=down` stops it.
control-plane: $(STAMP)
	$(BIN)/python -m prefect_nemo.testing.control_plane $(or $(CP),build)

## ruff, then mypy: strict on prefect_nemo outside testing/ (config in pyproject.toml [tool.mypy])
lint: $(STAMP)
	$(BIN)/ruff check prefect_nemo flows tests bench examples docs
	$(BIN)/mypy

## The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or anchor, a page
## missing from the nav, or a docstring or API reference that does not resolve fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

## Every benchmark; prints one key=value line per figure.
bench: $(STAMP)
	$(BIN)/python -m bench.run_all

## Scale: 100 and 1,000 simulated jobs, 200 real Ray and Slurm jobs, SQLite vs PostgreSQL, each vs
## the raw client (~30 min); `make bench` prints its last.
bench-scale: $(STAMP) $(NR_STAMP)  # its Slurm part runs in the extras environment
	$(BIN)/python -m bench.scale

## A peer at scale: dagster-ray's PipesRayJobClient, ours and the raw client, 200 Ray jobs each
## on one local Ray, 3 interleaved rounds (~75 min on 2 cores); optional: nothing else needs
## .venv-peers.
bench-peers: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python -m bench.peers

clean:
	rm -rf $(VENV) $(NR_VENV) $(PEERS_VENV) .prefect-nemo .pytest_cache .mypy_cache site
