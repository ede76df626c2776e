# shardstream: the two commands a user needs are `make demo` and `make test`.
# Everything they need is installed by them: the Python environment (.venv, cached outside the
# clone, see scripts/venv.sh) and the Rust build.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
CARGO ?= cargo
export CARGO_TERM_COLOR ?= never
# A clean clone (CI) builds everything once: incremental compilation's state would be ~1.3 GB of
# the test build's ~3.5 GB that no later build reuses, and CI has run out of disk before.
ifeq ($(CI),true)
export CARGO_INCREMENTAL ?= 0
endif

.PHONY: all demo test test-deploy bench bench-rdma chaos venv venv-bench develop develop-release lint fmt clippy rust-test py-test clean help
.PHONY: fmt-py typos typecheck deny msrv fuzz fuzz-short

help:
	@echo "make demo   build, generate a small dataset, start a daemon, stream two epochs"
	@echo "make test   format, lint, Rust unit/property tests, Python end-to-end tests"
	@echo "make bench  shardstream vs peers on one generated dataset (writes bench/RESULTS.md)"
	@echo "make chaos  daemon kills, S3 faults, 64 clients, a full cache disk (writes CHAOS.md)"

venv:
	@bash scripts/venv.sh >/dev/null

venv-bench:
	@bash scripts/venv.sh --bench >/dev/null

# Builds the Python package (native module + the `shardstream` command) into the venv.
develop: venv
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --quiet -m loader-py/Cargo.toml

develop-release: venv
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --quiet --release -m loader-py/Cargo.toml

demo: develop-release
	$(PY) scripts/demo.py

fmt:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p shardstream --all-targets --features failpoints -- -D warnings

lint: venv
	$(VENV)/bin/ruff check loader-py/python loader-py/tests tests bench scripts fuzz

# Gates (issue 13). Each is quick (seconds) once its tool is installed.
fmt-py: venv
	$(VENV)/bin/ruff format --check loader-py/python loader-py/tests tests bench scripts fuzz

typos: venv
	$(VENV)/bin/typos

# mypy --strict on the package; stubtest checks the hand-written _native.pyi against the built
# module (a class or function missing from the stub, or a wrong signature, fails).
typecheck: develop
	$(VENV)/bin/mypy --strict loader-py/python
	$(PY) -m mypy.stubtest --allowlist loader-py/stubtest-allowlist.txt shardstream._native

# Licences, bans, sources (and advisories when the RustSec database is reachable): deny.toml.
deny:
	bash scripts/deny.sh

# rust-version in Cargo.toml against the resolved dependencies and the installed rustc.
msrv: venv
	$(PY) scripts/msrv.py $(CARGO)

# The failpoint tests need the `failpoints` feature (off in every other build).
rust-test:
	bash scripts/libfabric.sh
	$(CARGO) test --workspace
	$(CARGO) test -p shardstream --features failpoints --test failpoints

# libFuzzer runs of fuzz/ (nightly toolchain; elsewhere they print that they were skipped). The
# same targets run as plain tests in rust-test on every toolchain.
fuzz-short:
	bash scripts/fuzz.sh --short

fuzz:
	bash scripts/fuzz.sh

# The venv is shared by every clone on the machine (scripts/venv.sh) and its editable install
# names the clone that last ran `make develop`: a run here imports this clone's package (and its
# `shardstream` command's daemon) whatever another clone does meanwhile. Not for the bench, whose
# wheel must not be shadowed by the debug module in the tree.
demo py-test typecheck chaos test-deploy: export PYTHONPATH := $(CURDIR)/loader-py/python$(if $(PYTHONPATH),:$(PYTHONPATH))

# The end-to-end tests run a real S3-compatible server (s3s-fs, built once per machine); the
# failpoint tests a daemon built with `--features failpoints`; tests/chaos the short chaos suite.
py-test: develop
	@bash scripts/netns-tools.sh   # iproute2 for the two-host tests (tests/netns.py)
	bash scripts/libfabric.sh
	SHARDSTREAM_S3_SERVER="$$(bash scripts/s3-server.sh)" SHARDSTREAM_FAIL_BIN="$$(bash scripts/failpoint-bin.sh)" \
		$(PY) -m pytest -q tests loader-py/tests --ignore=tests/deploy

# The full chaos suite (~30 s here); mounts a tmpfs for the full-disk scenario (root).
chaos: develop
	SHARDSTREAM_S3_SERVER="$$(bash scripts/s3-server.sh)" $(PY) tests/chaos/run.py --out CHAOS.md

# The deployment files (deploy/), each run for real: a private Slurm with a job as a non-root
# user, the Kubernetes manifests rendered, validated and run as written, promtool, systemd-analyze,
# hadolint, shellcheck. Needs root (apt-get, useradd, slurmd).
test-deploy: develop
	bash scripts/deploy-tools.sh $(VENV)
	$(CARGO) build -p shardstream --bin shardstream
	SHARDSTREAM_S3_SERVER="$$(bash scripts/s3-server.sh)" $(PY) -m pytest -q --timeout=900 tests/deploy

test: venv fmt fmt-py typos clippy lint deny msrv typecheck rust-test fuzz-short py-test test-deploy

BENCH_VENV := .venv-bench
INLINE_BASELINE ?= 88b45a7

bench: venv-bench
	@# A wheel, not an editable install: an editable one puts the native module in the source
	@# tree, where the next `make test` replaces it with a debug build under the bench's feet.
	rm -rf target/bench-wheel
	$(BENCH_VENV)/bin/maturin build --quiet --release -m loader-py/Cargo.toml -o target/bench-wheel
	$(BENCH_VENV)/bin/pip install --quiet --force-reinstall --no-deps target/bench-wheel/shardstream-*.whl
	$(CARGO) build --release -p shardstream --bin shardstream --example plan_quality --example index_memory --example s3_fetch --example s3_put
	$(BENCH_VENV)/bin/python bench/run.py --epochs 2 --out bench/RESULTS.md $(BENCH_ARGS)
	$(BENCH_VENV)/bin/python bench/decode_bench.py --epochs 2 --out bench/DECODE_RESULTS.md $(DECODE_BENCH_ARGS)
	$(BENCH_VENV)/bin/python bench/shm_bench.py --out bench/SHM_RESULTS.md
	$(BENCH_VENV)/bin/python bench/parquet_bench.py --out bench/PARQUET_RESULTS.md
	@# The image set as `pack --format parquet` writes it (uncompressed PLAIN), read also
	@# through the node cache, where the copies' mappings serve the values.
	$(BENCH_VENV)/bin/python bench/parquet_bench.py --datasets image --layout plain \
		--peers pa_seq,pa_shuffle,hf_map,floor,ss_arrow,ss_arrow+copy+warm,ss_views,ss_views+warm,ss_views+copy,ss_views+copy+warm,ss_views+copy+node \
		--out bench/PARQUET_PLAIN_RESULTS.md
	bash scripts/iperf3.sh
	@# Issue 11's speed targets are ratios to the inline transport as it was when the issue was
	@# filed (main at 88b45a7): that build is measured in the same rounds (built once, ~10 min).
	$(BENCH_VENV)/bin/python bench/inline_bench.py --out bench/INLINE_RESULTS.md \
	  --variant "baseline $(INLINE_BASELINE)=$$(bash scripts/baseline-build.sh $(INLINE_BASELINE) target/bench-baseline/inline $(BENCH_VENV)/bin/python)"
	$(BENCH_VENV)/bin/python bench/rdma_setup.py --out bench/RDMA_SETUP.md
	export SHARDSTREAM_S3_SERVER="$$(bash scripts/s3-server.sh)"; \
	$(BENCH_VENV)/bin/python bench/pack_bench.py --out bench/PACK_RESULTS.md && \
	$(BENCH_VENV)/bin/python bench/s3_bench.py --out bench/S3_RESULTS.md
	$(MAKE) bench-rdma

# The rdma data plane's raw ring writes vs single-stream iperf3, same run (libfabric tcp/shm).
bench-rdma:
	bash scripts/libfabric.sh --dev
	$(CARGO) build --release -p shardstream-fabric --example ringwrite
	python3 bench/rdma_bench.py --out bench/RDMA_RESULTS.md

clean:
	$(CARGO) clean
	rm -rf .demo bench/data
