# prefixlab: `make demo` runs the main job, `make test` runs the tests; both install into .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,dist
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-cpus check-triton-cpu bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -c $(VENV)/torch-constraint.txt "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -c $(VENV)/torch-constraint.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: install
	$(BIN)/prefixlab demo $(ARGS)

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The suite again with other x86 CPUs' code paths forced on this one (ATen, inductor, MKL, oneDNN, numpy): AVX2, then
# generic SSE4 code on 3 threads; each in a fresh inductor cache, since inductor's cache does not key on the ISA.
CPU_AVX2 := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
	NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"
CPU_GENERIC := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 \
	NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL AVX512_SPR" OMP_NUM_THREADS=3

test-cpus: install
	rm -rf $(VENV)/inductor-avx2 $(VENV)/inductor-generic
	TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-avx2 $(CPU_AVX2) $(BIN)/python -m pytest -q $(PYTEST_ARGS)
	TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-generic $(CPU_GENERIC) $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# prefixlab's fla / mamba_ssm backends against those packages' real Triton kernels, without a GPU (Triton's CPU
# interpreter, fp32; downloads triton / fla / mamba_ssm into a scratch directory, never into .venv; minutes)
check-triton-cpu: install
	bash benchmarks/triton_cpu_check.sh

# -s: each benchmark prints what it measured as it goes; -rs: why any was skipped (e.g. no shared data)
bench: install
	$(BIN)/python -m pytest benchmarks --benchmark-enable -p no:cacheprovider -s -rs $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check prefixlab tests benchmarks examples

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks *.egg-info
