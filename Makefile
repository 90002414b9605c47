# The two set-up commands of the README: `make run` and `make test`. Each creates .venv and installs
# what it needs on first use. torch and torchvision are installed first, at the versions whose wheels lie on
# the build machines' disk (a bare `torch` pulls several GB of CUDA wheels); pyproject.toml only bounds them
# from below, so that Turnstile installs beside the torch of slime's image.
PYTHON ?= python3
VENV := .venv
INSTALLED := $(VENV)/.installed

.PHONY: run test bench sglang slime-image agent-clis

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -qq --progress-bar off torch==2.14.1 torchvision==0.29.1
	$(VENV)/bin/pip install -qq --progress-bar off -e '.[dev]'
	touch $(INSTALLED)

run: $(INSTALLED)
	$(VENV)/bin/turnstile run $(ARGS)

test: $(INSTALLED)
	$(VENV)/bin/python -m pytest $(ARGS)

# The end-to-end tier's SGLang (its own venv, cached under $$TURNSTILE_CACHE; ~11 GB, a few minutes once).
sglang: $(INSTALLED)
	$(VENV)/bin/python -m tests.sglang_cpu.server install

# The install test's venv with slime's image's torch, torchvision, transformers and numpy (cached under
# $$TURNSTILE_CACHE; ~5 GB, about a minute on a fast link once).
slime-image: $(INSTALLED)
	$(VENV)/bin/python -m tests.slime_image install

# The agent CLIs the gateway is tested with, from npm at pinned versions (cached under $$TURNSTILE_CACHE; needs npm).
agent-clis: $(INSTALLED)
	$(VENV)/bin/python -m tests.agent_clis install

bench: $(INSTALLED)
	mkdir -p reports
	$(VENV)/bin/python -m benchmarks.micro encoding_speed --out reports/encoding_speed.json
	$(VENV)/bin/python -m benchmarks.micro trajectory_memory --out reports/trajectory_memory.json
	$(VENV)/bin/python -m benchmarks.micro local_concurrency --out reports/local_concurrency.json
	$(VENV)/bin/python -m benchmarks.micro mm_merge --out reports/mm_merge.json
	$(VENV)/bin/python -m benchmarks.micro overhead --out reports/overhead
	$(VENV)/bin/python -m benchmarks.micro bridge_overhead --out reports/bridge_overhead.json
	$(VENV)/bin/python -m benchmarks.longtail --size large --out reports/longtail
	$(VENV)/bin/python -m benchmarks.faults.hung_env --out reports/hung_env.json
	$(VENV)/bin/python -m benchmarks.micro stream_latency --out reports/stream_latency.json
	$(VENV)/bin/python -m benchmarks.agents.gateway --out reports/gateway.json
	$(VENV)/bin/python -m benchmarks.agents.gateway_live --out reports/gateway_live.json
	$(VENV)/bin/python -m benchmarks.micro sandbox --out reports/sandbox.json
