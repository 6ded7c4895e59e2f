# The two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint clean

install: $(STAMP)

# Torch first, pinned: with no GPU, `pip install torch==2.13.0` takes the local CPU
# build instead of a multi-GB CUDA one. The project's own range then installs nothing more.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	# Build the native extension (radix tree, page free list, lifecycle) once now (about a minute),
	# not inside the first demo or test run. Without a compiler this only reports it:
	# the Python tree and the numpy allocator are the fallbacks.
	$(PY) -c "from hicache.jit import native_available as ok; print('native extension:', 'built' if ok() else 'unavailable (Python fallbacks)')"
	touch $(STAMP)

demo: install
	$(VENV)/bin/hicache demo

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check hicache tests bench

clean:
	rm -rf $(VENV) build .pytest_cache
