# The two commands of the README: `make up` and `make test`.
# Everything else is plain CMake + CTest underneath.

BUILD      ?= build
ASAN_BUILD ?= build-asan
CMAKE_ARGS ?=
# Extra flags of `pdserve up`, e.g. UP_ARGS="--prefill 2 --port 8080".
UP_ARGS    ?=
# ctest parallelism: tests start real processes on loopback, two per core is plenty.
TEST_JOBS  ?= 2
# `make test` on a machine with nvcc but no GPU (CI) compiles the CUDA
# kernels for sm_90 alone: there they are compiled to be checked, never run,
# and each architecture costs a full device compile of every kernel. Every
# other build keeps the project's default (sm_80 and sm_90 code, compute_90
# PTX); CMAKE_ARGS given on the command line replace this.
HAVE_NVCC := $(wildcard /usr/local/cuda/bin/nvcc)
HAVE_GPU   = $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')

.PHONY: up test deps configure build build-pdserve build-asan test-unit-asan format clean

# The router on :8000 with one prefill and one decode worker on the tiny model;
# ports match deploy/local/prometheus.sh. Ctrl-C stops it. Builds only the
# binary it runs: the test programs are `make test`'s business.
up: deps build-pdserve
	$(BUILD)/pdserve up --dir .deps/up $(UP_ARGS)

test: CMAKE_ARGS += $(if $(and $(HAVE_NVCC),$(filter 0,$(HAVE_GPU))),-DCMAKE_CUDA_ARCHITECTURES=90-real)
test: deps build build-asan
	cd $(BUILD) && PATH="$(CURDIR)/.deps/bin:$$PATH" ctest --output-on-failure -j $(TEST_JOBS) --timeout 900
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(TEST_JOBS) -L unit --timeout 900

deps:
	./deploy/local/install-deps.sh

configure:
	@echo "== configuring $(BUILD)/ (CMake, Ninja)"
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_ARGS)

build: configure
	@echo "== building everything in $(BUILD)/: the pdserve binary, tests and benchmarks"
	cmake --build $(BUILD)

build-pdserve: configure
	@echo "== building the pdserve binary only ($(BUILD)/pdserve)"
	cmake --build $(BUILD) --target pdserve

# Unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
build-asan:
	cmake --preset asan $(CMAKE_ARGS) >/dev/null
	cmake --build $(ASAN_BUILD) --target unit_tests

format:
	git ls-files '*.h' '*.cpp' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
