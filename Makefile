# The two commands: `make demo` runs the main job, `make test` runs the tests.
# Each creates .venv with what it needs on a machine that has only Python.
PYTHON ?= python3
VENV ?= .venv
# torch and torchvision from the registry as a matching pair (torchvision's C ops load only
# against the torch build it was made for), and the torchcodec made for that torch. The pair that
# installs and runs on the CPU differs by architecture: on Arm torch 2.9.1, for which the registry
# has no Arm torchcodec (videos decode with PyAV there). Override any of them: make TORCH=... test
ARCH := $(shell uname -m)
ifeq ($(ARCH),$(filter $(ARCH),aarch64 arm64))
TORCH ?= torch==2.9.1
TORCHVISION ?= torchvision==0.24.1
TORCHCODEC ?=
else
TORCH ?= torch==2.14.1
TORCHVISION ?= torchvision==0.29.1
TORCHCODEC ?= torchcodec==0.17.*
endif
PY := $(VENV)/bin/python

.PHONY: install demo test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)" "$(TORCHVISION)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH)" "$(TORCHVISION)" $(if $(TORCHCODEC),"$(TORCHCODEC)")
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m vlmrun.cli caption assets/images

# The browser test drives Debian's chromium (no browser download), the video tests decode with
# torchcodec on Debian's FFmpeg libraries (as transformers does); install them when missing.
test: install
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "NOTE: no chromium (apt-get install chromium): the web demo's browser test will be skipped"; fi; }
	@command -v ffmpeg >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q ffmpeg; \
	  else echo "NOTE: no FFmpeg (apt-get install ffmpeg): the video tests will be skipped"; fi; }
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .cache
