# posttrain: `make speedrun` and `make test` set everything up on a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PRESET ?= tiny
ARGS ?=

.PHONY: setup sglang-env speedrun test test-fast test-cluster cluster cluster-tools bench serve clean

setup: $(VENV)/.installed $(VENV)/.kernels

# torch first, from its exact pin (the CPU wheel on these machines); deepspeed's sdist imports
# torch at build time, so it is built without isolation against the torch just installed.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install -q --disable-pip-version-check --no-build-isolation -c constraints.txt deepspeed
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
	touch $@

# The C++ kernels (trainer/csrc: the fast decoder's step, the training forward's fused ops), built once
# per machine into ~/.cache/posttrain/kernels (about 15 s on 2 cores). Without a compiler they are skipped and
# decoding and training run on torch ops (slower, same results up to rounding).
$(VENV)/.kernels: $(VENV)/.installed $(wildcard trainer/csrc/*.cpp) trainer/kernels.py
	$(BIN)/python -m trainer.kernels || echo "posttrain: the C++ kernels did not build; decoding and training will use torch ops"
	touch $@

# The GSM8K presets load openai/gsm8k by hub name; where a local copy is (GSM8K_DIR, with train.jsonl and
# test.jsonl), they read it instead, offline (docs/gsm8k.md).
GSM8K_DIR ?= ../shared/data/gsm8k
GSM8K_FILES = $(if $(and $(findstring gsm8k,$(PRESET)),$(wildcard $(GSM8K_DIR)/train.jsonl)),--set data.source=files \
	--set data.train=$(abspath $(GSM8K_DIR))/train.jsonl --set data.test=$(abspath $(GSM8K_DIR))/test.jsonl)
speedrun: setup
	$(BIN)/posttrain speedrun --preset $(PRESET) $(GSM8K_FILES) $(ARGS)

# SGLang servers run from their own environment (sglang pins another torch and transformers), built
# once per machine outside the clone and shared by every clone: see deployments/sglang_env.py.
# SGLANG_DEVICE=auto builds the CUDA variant where nvidia-smi exists, else the CPU one.
SGLANG_DEVICE ?= auto
sglang-env: setup
	$(BIN)/python -m deployments.sglang_env build --device $(SGLANG_DEVICE)

# The tests run real SGLang servers in CPU mode, so they need the CPU variant. Two workers, a test
# file each at a time (tests/conftest.py starts the longest files first): most tests wait on
# processes starting (servers, ranks, CLI runs) as much as they compute, and one worker alone left
# a core idle for about 40 % of the suite. The 15 slowest tests are listed at the end.
PYTEST_WORKERS ?= 2
test: setup cluster-tools
	$(BIN)/python -m deployments.sglang_env build --device cpu
	$(BIN)/python -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# The inner loop: the tests not marked slow, under a minute on 2 cores (no flow, no server, no real
# weights; no Prefect server is started for them). See docs/testing.md.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# The several-machine tests (tests/test_cluster.py) simulate hosts with Linux namespaces, as root, each
# with its own sshd; DeepSpeed's runner fans out with pdsh. Installed here where missing (Debian).
cluster-tools:
	@if [ "$$(id -u)" = 0 ] && ! { test -x /usr/sbin/sshd && command -v pdsh >/dev/null && command -v ip >/dev/null; }; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client pdsh iproute2 >/dev/null) \
		|| echo "posttrain: could not install openssh-server and pdsh; the cluster tests will skip and say so"; fi

# The cluster tests alone (about 10 min on 2 cores), none skipped when run as root.
test-cluster: setup cluster-tools
	$(BIN)/python -m pytest -q -ra tests/test_cluster.py

# Three simulated hosts for a person to try by hand (docs/cluster.md); Ctrl-C tears them down.
cluster: setup cluster-tools
	$(BIN)/python -m tests.cluster

# TRL (the bench extra, pinned in constraints.txt) is installed into the same environment, beside
# posttrain's own pins: both tools then run on the same torch and transformers.
bench: setup
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e ".[bench]"
	$(BIN)/python -m tests.bench $(BENCH_ARGS)

# Prefect server + process work pool + worker + MLflow UI on 127.0.0.1, every deployment in prefect.yaml;
# its Prefect state under .serve/prefect (or $PREFECT_HOME). SERVE_ARGS='--prefect-port 4300 --pool-limit 1'.
# SERVE_ARGS='--host ADDRESS --queue NAME' serves other machines, with credentials (docs/cluster.md).
serve: setup
	$(BIN)/python -m deployments.serve $(SERVE_ARGS)

clean:
	rm -rf artifacts mlflow.db mlruns
