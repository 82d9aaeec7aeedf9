# `make test` and `make demo` work on a fresh machine: each builds .venv and installs what it needs.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: test demo lint clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned explicitly: an unpinned torch pulls a multi-GB CUDA build onto CPU-only machines.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[server,test]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q -ra

demo: $(STAMP)
	$(PY) -m laya_pool demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
