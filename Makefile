# The two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint clean

install: $(STAMP)

# Torch first, pinned: with no GPU, `pip install torch==2.13.0` takes the local CPU
# build instead of a multi-GB CUDA one. The project's own range then installs nothing more.
# The C++ sources too: a change to them recompiles the installed module here, once.
$(STAMP): pyproject.toml setup.py buildtools/backend.py $(wildcard hicache/native/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	# setup.py compiles the native extension (radix tree, page free list, lifecycle) into
	# the package now, once, against the torch above (hence no build isolation), not in the
	# first demo or test run. Without a compiler the install still succeeds: the Python tree
	# and the numpy allocator are the fallbacks.
	$(PY) -m pip install -q 'setuptools>=77' ninja
	@echo 'installing hicache and compiling its native extension (about a minute)'
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	$(PY) -c "from hicache.native import build; print('native extension:', build.native_status())"
	touch $(STAMP)

demo: install
	$(VENV)/bin/hicache demo

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check hicache tests bench

clean:
	rm -rf $(VENV) build .pytest_cache hicache/native/_native*.so hicache/native/_native_build.json
