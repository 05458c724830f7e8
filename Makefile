# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv with what it needs on a machine that has only Python.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
TINY := .cache/tiny-qwen3-vl

.PHONY: install demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	@echo "NOTE: no trained default model is bundled yet. This demo captions assets/images with a TINY"
	@echo "      RANDOM-WEIGHT Qwen3-VL checkpoint built on the fly: the captions are meaningless tokens."
	@echo "      It shows the pipeline end to end; pass --model to vlmrun caption for a real checkpoint."
	$(PY) -m vlmrun.tiny_models qwen3_vl $(TINY)
	$(PY) -m vlmrun.cli caption assets/images --model $(TINY) --max-tokens 24

# The browser test drives Debian's chromium (no browser download); install it when missing.
test: install
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "NOTE: no chromium (apt-get install chromium): the web demo's browser test will be skipped"; fi; }
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .cache
