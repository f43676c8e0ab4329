# The two set-up commands: `make run` starts tensord, `make test` runs the
# suite. Both install the Debian 12 packages they need (as root) and build
# into build/. `make install` copies the build under PREFIX.
BUILD    ?= build
PREFIX   ?= /usr/local
DESTDIR  ?=
JOBS     ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=
DEBS     := cmake make gcc pkg-config libuv1-dev libprotobuf-c-dev \
            protobuf-c-compiler libjansson-dev libcriterion-dev libdlpack-dev \
            clang-14 libclang-rt-14-dev valgrind \
            python3-dev python3-numpy python3-torch python3-pytest \
            python3-pip python3-setuptools \
            python3-fastapi python3-uvicorn python3-httpx gunicorn
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# The interpreter the Python package is built and tested for: Debian's,
# which has python3-numpy and python3-torch (the first python3 on PATH may be
# another). PYTHON=... picks another; it needs numpy, torch and pytest.
PYTHON   ?= /usr/bin/python3

FUZZ_SECONDS ?= 60
FUZZ_ARGS ?=

.PHONY: all deps build install run test leakcheck bench soak asan tsan \
        valgrind fuzz clean

all: build

# Installs only what is missing, so a machine that has everything needs no
# network and no root.
deps:
	@missing=$$(for p in $(DEBS); do \
	  dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; \
	done); \
	if [ -n "$$missing" ]; then \
	  echo "installing:" $$missing; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(BUILD)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD) -DPython3_EXECUTABLE=$(PYTHON) $(CMAKE_FLAGS)

build: deps $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

# tensord, tensorctl, libtensord (.so and .a), tensord.h, tensord.pc and the
# CMake package under $(DESTDIR)$(PREFIX); refreshes the loader's cache when
# root installs into the system itself.
install: build
	DESTDIR="$(DESTDIR)" cmake --install $(BUILD) --prefix "$(PREFIX)"
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ] && command -v ldconfig >/dev/null; then ldconfig; fi

run: build
	exec $(BUILD)/daemon/tensord $(ARGS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) $(CTEST_ARGS)
	@tests/check-clean.sh $(BUILD)

# Proves the tests catch a leak: against a tensord built to leave every
# segment in /dev/shm (-DTD_TEST_LEAK=ON, never built otherwise) the suites
# that check each daemon as their tests end must go red.
LEAK_TARGETS := tensord tensorctl test_core test_views test_badinput \
                test_keys test_cli
leakcheck: deps
	cmake -S . -B build-leak -DTD_TEST_LEAK=ON
	cmake --build build-leak -j $(JOBS) --target $(LEAK_TARGETS)
	tests/leakcheck.sh build-leak

# The C benchmarks (tests/bench/run.sh), then the Python ones
# (python/bench/run.py, with $(PYTHON)); each starts its own tensord.
# TD_BENCH_ONLY="bench_ops bench_weights.py" runs only those: names ending in
# .py are the Python benchmarks.
bench: build
	@rc=0; only="$${TD_BENCH_ONLY:-}"; \
	c=$$(for b in $$only; do case $$b in *.py) ;; *) echo $$b ;; esac; done); \
	py=$$(for b in $$only; do case $$b in *.py) echo $$b ;; esac; done); \
	if [ -z "$$only" ] || [ -n "$$c" ]; then \
	  TD_BENCH_ONLY="$$c" tests/bench/run.sh $(BUILD) || rc=1; fi; \
	if [ -z "$$only" ] || [ -n "$$py" ]; then \
	  TD_BENCH_ONLY="$$py" $(PYTHON) python/bench/run.py $(BUILD) || rc=1; fi; \
	exit $$rc

# The soak test: 256 clients for SOAK_SECONDS against a private tensord, as
# root. SOAK_ARGS=--restart also SIGKILLs and restarts the daemon every ~15 s;
# SOAK_ARGS=--upgrade upgrades it live (tensord --upgrade) every ~6 s, and
# any error a client sees from it fails the run; both may be given.
SOAK_SECONDS ?= 300
SOAK_ARGS    ?=
soak: build
	@tests/soak/run.sh $(BUILD) $(SOAK_SECONDS) $(SOAK_ARGS)

# The whole suite under AddressSanitizer and UndefinedBehaviorSanitizer,
# the Python package's included: its suite runs Debian's interpreter with
# GCC's libasan preloaded (python/CMakeLists.txt).
asan:
	$(MAKE) test BUILD=build-asan CMAKE_FLAGS="-DTD_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug"

# The multi-threaded client tests (ctest label threads) under
# ThreadSanitizer, tensord included: any race fails them. They run with
# address-space randomisation off (setarch -R) where the kernel lets us:
# TSan's runtime aborts with "unexpected memory mapping" when
# vm.mmap_rnd_bits is larger than its memory layout allows.
tsan:
	$(MAKE) build BUILD=build-tsan CMAKE_FLAGS="-DTD_TSAN=ON -DCMAKE_BUILD_TYPE=Debug"
	norand=; if setarch "$$(uname -m)" -R true 2>/dev/null; then \
	  norand="setarch $$(uname -m) -R"; fi; \
	$$norand ctest --test-dir build-tsan --output-on-failure -L threads -j $(JOBS)
	@tests/check-clean.sh build-tsan

# The integration tests with every tensord under valgrind: it must exit with
# no error and no leak.
valgrind: deps
	cmake -S . -B build-valgrind -DTD_VALGRIND=ON
	cmake --build build-valgrind -j $(JOBS)
	ctest --test-dir build-valgrind --output-on-failure -L valgrind -j $(JOBS)
	@tests/check-clean.sh build-valgrind

# The libFuzzer targets, the request path, --state-dir loading and the
# safetensors header parser, for FUZZ_SECONDS in all (CI: 60), a third
# each. All run; any failing fails.
fuzz: deps
	[ -f build-fuzz/CMakeCache.txt ] || CC=clang-14 cmake -S . -B build-fuzz \
	  -DTD_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build-fuzz -j $(JOBS) --target fuzz_request fuzz_state fuzz_safetensors
	@half=$$(( $(FUZZ_SECONDS) / 3 )); [ $$half -gt 0 ] || half=1; rc=0; \
	tests/fuzz/run.sh build-fuzz/tests/fuzz/fuzz_request $$half $(FUZZ_ARGS) || rc=1; \
	tests/fuzz/run.sh build-fuzz/tests/fuzz/fuzz_state $$half $(FUZZ_ARGS) || rc=1; \
	tests/fuzz/run.sh build-fuzz/tests/fuzz/fuzz_safetensors $$half $(FUZZ_ARGS) || rc=1; \
	exit $$rc

clean:
	rm -rf $(BUILD) build-asan build-tsan build-fuzz build-valgrind build-leak
