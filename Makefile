# The two set-up commands of the README: `make run` and `make test`. Each creates .venv and installs
# what it needs on first use (torch and torchvision come from the wheels pinned in pyproject.toml).
PYTHON ?= python3
VENV := .venv
INSTALLED := $(VENV)/.installed

.PHONY: run test bench sglang

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -qq --progress-bar off -e '.[dev]'
	touch $(INSTALLED)

run: $(INSTALLED)
	$(VENV)/bin/turnstile run $(ARGS)

test: $(INSTALLED)
	$(VENV)/bin/python -m pytest $(ARGS)

# The end-to-end tier's SGLang (its own venv, cached under $$TURNSTILE_CACHE; ~11 GB, a few minutes once).
sglang: $(INSTALLED)
	$(VENV)/bin/python -m tests.sglang_cpu.server install

bench: $(INSTALLED)
	mkdir -p reports
	$(VENV)/bin/python -m benchmarks.encoding_speed --out reports/encoding_speed.json
	$(VENV)/bin/python -m benchmarks.trajectory_memory --out reports/trajectory_memory.json
	$(VENV)/bin/python -m benchmarks.local_concurrency --out reports/local_concurrency.json
	$(VENV)/bin/python -m benchmarks.mm_merge --out reports/mm_merge.json
	$(VENV)/bin/python -m benchmarks.overhead --out reports/overhead
	$(VENV)/bin/python -m benchmarks.bridge_overhead --out reports/bridge_overhead.json
	$(VENV)/bin/python -m benchmarks.longtail --size large --out reports/longtail
