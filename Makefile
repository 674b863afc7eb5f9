# Phalanx: `make demo` runs a local cluster doing real work; `make test` runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Let Python cache compiled modules (__pycache__, git-ignored) for every process make starts: an
# environment that sets PYTHONDONTWRITEBYTECODE (this machine's does) makes each controller,
# agent and command compile Phalanx's sources again at every start (0.27 s of CPU a controller,
# 0.16 s an agent, 0.11 s a `phalanx` command), and pytest rewrite every test module again in
# each worker: about a tenth of `make test`'s CPU on the 2-core machine.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test soak lint bench clean soak-chaos

install: $(VENV)/.installed

# The Slurm commands in .venv/bin become the compiled ones (docs/slurm.md, "What a call
# costs"); without a C compiler pip's Python console scripts stay, and say nothing different.
$(VENV)/.installed: pyproject.toml src/phalanx/slurm/commands.c
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Phalanx needs Python 3.11 or newer")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -m compileall -q src  # before parallel workers would each compile them
	$(BIN)/phalanx slurm-commands --install $(BIN) || echo "the Python Slurm commands stay in $(BIN)"
	@touch $@

demo: install
	$(BIN)/python scripts/demo.py

lint: install
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts
	$(BIN)/mypy

# `make test` runs the suite in three parts (tests/conftest.py says why): all but the `paired`
# and `serial` modules on TEST_WORKERS parallel workers, each module whole on one worker; then
# the modules that assert a fault's timeouts, three at a time; then those with tight timing
# bounds, one at a time with nothing beside them. Three workers on two cores: the system tests
# spend much of their time waiting on their clusters (two left a quarter of the CPU idle; the
# parallel part went from 615 s to 480 s with three, every test passing; four took as long as
# three, the CPU being busy throughout). The paired part mostly waits on its faults' timeouts:
# three at a time took 202 s against 254 s for two, the CPU still idle 29% of the time (median
# of 5 s samples), every test passing.
TEST_WORKERS ?= 3
# where the paired and serial tests live (tests/conftest.py TIMED_DIRS refuses one elsewhere):
# collecting all of tests/ again costs each of those parts ~12 s
TIMED_DIRS := tests/store tests/system

# The workflow tools' environment (.venv-tools: 42 s from a fresh clone, mostly PyTorch's
# wheel) is built while the project's own is installed and linted: they share nothing.
test:
	bash scripts/ensure-tools.sh > .ensure-tools.log 2>&1 & tools=$$!; \
	$(MAKE) --no-print-directory install lint; status=$$?; \
	wait $$tools; tools_status=$$?; cat .ensure-tools.log; \
	[ $$status -eq 0 ] && [ $$tools_status -eq 0 ]
	bash scripts/ensure-postgres.sh
	bash scripts/ensure-etcd.sh
	bash scripts/ensure-netns-tools.sh
	bash scripts/ensure-chromium.sh
	bash scripts/ensure-mpi.sh
	$(BIN)/pytest -q --durations=20 -m "not soak and not serial and not paired" \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
	$(BIN)/pytest -q --durations=10 -m "paired and not soak" -n 3 --dist loadfile --no-loadscope-reorder $(TIMED_DIRS)
	$(BIN)/pytest -q --durations=10 -m "serial and not soak" $(TIMED_DIRS)

# The long runs kept out of `make test`: the 1,000-node simulation, the chaos runs (a few
# rounds each; `make soak-chaos` is the hour-long one), Patroni's failover, PostgreSQL under a
# row lock and CPU hogs (tests/system/test_pg_load.py), the PyTorch DDP job's maintenance and
# preemption stops (tests/system/test_ddp.py), the --all-nodes case of the --no-kill torchrun
# recovery (tests/system/test_no_kill.py), and the API fuzzing at four times make test's
# depth. CI runs both.
soak: install
	bash scripts/ensure-postgres.sh
	bash scripts/ensure-etcd.sh
	bash scripts/ensure-netns-tools.sh
	bash scripts/ensure-tools.sh
	$(BIN)/pytest -q --durations=10 -m soak
	PHX_API_FUZZ_EXAMPLES=100 $(BIN)/pytest -q tests/api/test_schemathesis.py

# The chaos soak (docs/security.md "Faults"): random faults (controller, agent and authd kills,
# pauses, partitions in network namespaces, PostgreSQL failovers) on SQLite, then on
# PostgreSQL, SOAK_MINUTES each (SOAK_ROUNDS at most), then the history check of each run.
# By hand: `make soak-chaos` (an hour of rounds: 965 to 1,002 measured). CI runs a short one.
SOAK_MINUTES ?= 30
SOAK_ROUNDS ?= 2000
soak-chaos: install
	bash scripts/ensure-postgres.sh
	bash scripts/ensure-netns-tools.sh
	PHX_CHAOS_SOAK=1 PHX_CHAOS_MINUTES=$(SOAK_MINUTES) PHX_CHAOS_ROUNDS=$(SOAK_ROUNDS) \
	PHX_CHAOS_TIMEOUT=$$(( $(SOAK_MINUTES) * 60 + 900 )) \
	$(BIN)/pytest -q -s -p no:cacheprovider tests/system/test_chaos.py

bench: install
	$(BIN)/python bench/submit.py

clean:
	rm -rf $(VENV) demo-state .pytest_cache .mypy_cache .ruff_cache
