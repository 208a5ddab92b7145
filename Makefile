# The README's two commands:
#   make train   - the main job: a real training run with offload (on the GPU when the venv's torch
#                  sees one, else on the CPU)
#   make test    - every test suite: C++ tests, ASan+UBSan and TSan builds of them, pytest
#   make test-gpu - the GPU suite (pytest -m gpu): every user path on CUDA, a few minutes
# Both set up a local virtual environment (.venv) first (.ci/bootstrap.sh).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
ifeq ($(CI),true)
WERROR := ON
else
WERROR ?= OFF
endif
CMAKE = $(shell test -x $(VENV)/bin/cmake && echo $(VENV)/bin/cmake || echo cmake)
CMAKE_TEST_FLAGS = -DPYINFINITY_PYTHON=OFF -DPYINFINITY_TESTS=ON -DPYINFINITY_WERROR=$(WERROR)
GEN = $(shell (test -x $(VENV)/bin/ninja || command -v ninja) >/dev/null 2>&1 && echo "-G Ninja")
# Small enough for a CPU in a few minutes; parameters and optimizer states on NVMe (SWAP_DIR,
# a git-ignored folder here; point it at a real NVMe mount to measure one).
SWAP_DIR ?= .swap
# Without a GPU: 24.6 MiB of weights against a 16 MiB device budget, everything on NVMe: minutes on
# 2 cores (README and BENCHMARKS.md say how many).
TRAIN_ARGS_CPU ?= --model-size small --steps 20 --seq 128 --batch 4 --offload nvme --nvme $(SWAP_DIR) \
	--gpu-memory 16MiB --device cpu
# With a GPU (the venv's torch sees one): the 0.81B "1b" preset, whose bf16 weights (1.51 GiB) exceed
# the 1 GiB device budget, parameters and optimizer states in pinned RAM: a minute or two on an H200.
TRAIN_ARGS_GPU ?= --model-size 1b --steps 40 --seq 512 --batch 4 --checkpoint-activations --offload cpu \
	--gpu-memory 1GiB --device cuda
# Decided when the recipe runs (after `build` made the venv); TRAIN_ARGS=... replaces either.
HAS_GPU = $(shell $(PY) -c "import torch; print(1 if torch.cuda.is_available() else '')" 2>/dev/null)
TRAIN_ARGS ?= $(if $(HAS_GPU),$(TRAIN_ARGS_GPU),$(TRAIN_ARGS_CPU))

.PHONY: train test test-note test-quick test-gpu venv build test-cpp test-asan test-tsan test-python clean

# What the extension is built from: `make build` reinstalls it only when one of these is newer
# than the stamp (a second `make build` with nothing changed does nothing).
EXT_SOURCES := $(shell find csrc -type f 2>/dev/null) CMakeLists.txt setup.py pyproject.toml

$(VENV)/.bootstrapped: .ci/requirements.txt .ci/bootstrap.sh
	bash .ci/bootstrap.sh $(PYTHON) $(VENV)
	touch $@

venv: $(VENV)/.bootstrapped

$(VENV)/.built: $(VENV)/.bootstrapped $(EXT_SOURCES)
	PYINFINITY_WERROR=$(if $(filter ON,$(WERROR)),1,0) CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) \
	  PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

train: build  # the run creates SWAP_DIR when it is missing and removes it at the end
	$(PY) -m pyinfinity train $(TRAIN_ARGS)

TEST_TIME_NOTE = "make test: the C++ suites (plain, ASan+UBSan, TSan builds; about 8 min on 2 cores), then pytest's \
	1,450 tests: about 30 min in all on a quiet 2-core machine, 50 on a busy one. For a first check: make test-quick"

test: test-note build test-cpp test-asan test-tsan test-python

test-note:
	@echo $(TEST_TIME_NOTE)

# A first check in a few minutes: the config, the README's examples, the engine's training paths
# on the CPU, the swap layer and logging. `make test` stays the full suite.
QUICK_TESTS = tests/python/test_config.py tests/python/test_readme.py tests/python/test_swap_engine.py \
	tests/python/test_zero_partition.py tests/python/test_logging.py tests/python/test_docs.py
test-quick: build
	$(PY) -m pytest -q -rs -p no:cacheprovider $(QUICK_TESTS)

# $(1): build dir, $(2): extra cmake flags, $(3): environment for the test run
define cpp_suite
	$(CMAKE) -S . -B $(1) $(GEN) $(CMAKE_TEST_FLAGS) $(2) >/dev/null
	$(CMAKE) --build $(1) -j $(JOBS)
	cd $(1) && $(3) ctest --output-on-failure
endef

test-cpp: venv
	$(call cpp_suite,build-tests,-DCMAKE_BUILD_TYPE=Release,)

test-asan: venv
	$(call cpp_suite,build-asan,-DCMAKE_BUILD_TYPE=Debug -DPYINFINITY_SANITIZE=address,ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1)

test-tsan: venv
	$(call cpp_suite,build-tsan,-DCMAKE_BUILD_TYPE=RelWithDebInfo -DPYINFINITY_SANITIZE=thread,TSAN_OPTIONS=halt_on_error=1)

test-python: build
	$(PY) -m pytest -q -rs -p no:cacheprovider tests/python

# The GPU suite in one process: every user path on CUDA (README's examples, `train` at `make
# train`'s GPU size, fine-tune/export/from_pretrained, save/SIGKILL/resume, DeepSpeed with
# pyinfinity as its backend when deepspeed is installed, the 1.1B budget grid) and the CUDA tests
# of the other files. Without a CUDA device every test is skipped (-rs says why).
test-gpu: build
	$(PY) -m pytest -q -p no:cacheprovider -rs -m gpu tests/python

clean:
	rm -rf build build-tests build-asan build-tsan pyinfinity/_C*.so *.egg-info $(VENV)/.built
