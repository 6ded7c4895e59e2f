# The two commands: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test sanitize lint clean

install: $(STAMP)

# Torch first, pinned: with no GPU, `pip install torch==2.13.0` takes the local CPU
# build instead of a multi-GB CUDA one. The project's own range then installs nothing more.
# The C++ sources too: a change to them recompiles the installed module here, once.
$(STAMP): pyproject.toml setup.py buildtools/backend.py hicache/buildcache.py hicache/memory/copier.c $(wildcard hicache/native/csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	# setup.py compiles the native extension (radix tree, page free list, lifecycle) and the
	# C row copier into the package now, once, against the torch above (hence no build
	# isolation), not in the first demo or test run, and prunes stale run-time builds from
	# ~/.cache/hicache. Without a compiler the install still succeeds: the Python tree, the
	# numpy allocator and torch copies are the fallbacks.
	$(PY) -m pip install -q 'setuptools>=77' ninja
	@echo 'installing hicache and compiling its native extension (about a minute)'
	$(PY) -m pip install -q --no-build-isolation -e '.[dev]'
	$(PY) -c "from hicache.native import build; print('native extension:', build.native_status())"
	$(PY) -c "from hicache.memory import copier; print('row copier:', copier.copier_status())"
	touch $(STAMP)

demo: install
	$(VENV)/bin/hicache demo

test: install
	$(PY) -m pytest -q

# The native extension under AddressSanitizer and UndefinedBehaviorSanitizer (its own
# build directory; the installed module is untouched), running the native tree's
# differential, contract and bad-input tests and a random-call fuzzer against the
# Python tree for SANITIZE_SECONDS. A Python process needs the ASan runtime preloaded.
# --capture=sys leaves file descriptor 2 alone: a sanitizer report ends the process,
# and with pytest's default capture it would vanish with it.
SANITIZE_SECONDS ?= 90
SANITIZE_ENV = LD_PRELOAD="$$($${CXX:-c++} -print-file-name=libasan.so) $$($${CXX:-c++} -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 HICACHE_NATIVE=sanitize
sanitize: install
	@# Builds it (a few minutes) and fails here, instead of skipping every test, if it does not load.
	$(SANITIZE_ENV) $(PY) -c "from hicache.native import build; build.load_native(); print('sanitized:', build.native_status())"
	$(SANITIZE_ENV) HICACHE_FUZZ_SECONDS=$(SANITIZE_SECONDS) timeout 900 $(PY) -m pytest -q -p no:cacheprovider --capture=sys \
		tests/tree/test_tree_differential.py tests/tree/test_tree_contracts.py \
		tests/tree/test_tree_errors.py tests/tree/test_tree_fuzz.py

# ruff over the code and tests; mypy over hicache/ (configured in pyproject.toml: strict
# on the modules that define the public API).
lint: install
	$(VENV)/bin/ruff check hicache tests bench
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache hicache/native/_native*.so hicache/native/_native_build.json \
		hicache/memory/_copier*.so
