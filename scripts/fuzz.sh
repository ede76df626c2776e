#!/usr/bin/env bash
# Runs the cargo-fuzz targets of fuzz/ under libFuzzer.
#   scripts/fuzz.sh --short        each target for FUZZ_SECONDS (default 5): `make fuzz-short`,
#                                  part of `make test`; only where the instrumented build exists
#                                  (or FUZZ_BUILD=1), otherwise it says so and why
#   scripts/fuzz.sh [target...]    each target (default all) for FUZZ_SECONDS (default 300)
#
# libFuzzer needs a nightly toolchain (cargo fuzz passes -Z flags). Where there is none, this says
# so and what ran instead, and exits 0: the same target bodies run on every toolchain as plain
# tests over the seeds and generated mutations (server/tests/fuzz_targets.rs, in `make rust-test`).
#
# Each run starts from the committed seeds (fuzz/seeds/<target>/) plus what earlier runs on this
# machine found (fuzz/corpus/<target>/, not committed). A crash leaves its input in
# fuzz/artifacts/<target>/ and fails the run; fix it, then add the input to the seeds.
set -euo pipefail
cd "$(dirname "$0")/.."
short=0
if [ "${1:-}" = "--short" ]; then short=1; shift; fi
seconds=${FUZZ_SECONDS:-$([ $short = 1 ] && echo 5 || echo 300)}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(ls fuzz/fuzz_targets | sed -n 's/\.rs$//p')
fi

toolchain=${FUZZ_TOOLCHAIN:-nightly}
# Listed, not run: `rustup run` of a missing toolchain may try to download it.
if ! rustup toolchain list 2>/dev/null | grep -q "^$toolchain"; then
  echo "fuzz: SKIPPED libFuzzer runs of ${targets[*]}: no '$toolchain' toolchain here (cargo fuzz" \
    "needs one; it cannot be downloaded on this machine). The same targets ran as plain tests over" \
    "the seeds and generated mutations: cargo test -p shardstream --test fuzz_targets."
  exit 0
fi
cache=${SHARDSTREAM_CACHE:-$HOME/.cache/shardstream}
# Kept outside the clone: the instrumented build of the daemon's dependencies takes minutes, once
# per machine, not once per clone.
target_dir="$cache/fuzz-target"
# No sanitizer: the readers under test are safe Rust, so AddressSanitizer would find nothing that
# bounds checks do not, at twice the build time; panics, timeouts and oversized allocations
# (-malloc_limit_mb) are what a run looks for.
# The fuzz crate resolves the workspace's exact dependency versions: its lock file starts as a
# copy of the workspace's (cargo adds libfuzzer-sys), so it is not committed and never drifts.
cp Cargo.lock fuzz/Cargo.lock
build=(cargo +"$toolchain" fuzz build --fuzz-dir fuzz --sanitizer none --debug-assertions --target-dir "$target_dir")
if [ ! -d "$target_dir" ]; then
  # The instrumented build of the daemon's whole dependency tree costs more than all of `make test`
  # on two cores; a short run does not start it (CI's clean machines would pay it every time).
  if [ $short = 1 ] && [ "${FUZZ_BUILD:-0}" != 1 ]; then
    echo "fuzz: SKIPPED the ${seconds}s libFuzzer runs of ${targets[*]}: no instrumented build on this" \
      "machine yet ($target_dir), and making one takes 6-14 minutes on two cores. Run \`make fuzz\`" \
      "(or FUZZ_BUILD=1 make fuzz-short) once to build it; later short runs take seconds. The same" \
      "targets ran as plain tests over the seeds and generated mutations in rust-test."
    exit 0
  fi
  echo "==> fuzz: first build on this machine (the daemon's dependencies, instrumented: 6-14 minutes on two cores)" >&2
fi
# `cargo +nightly fuzz` finds the cargo-fuzz binary on PATH.
PATH="$(dirname "$(bash scripts/tool.sh cargo-fuzz)"):$PATH"
for t in "${targets[@]}"; do "${build[@]}" "$t" >&2; done

# Every change to the project's crates leaves their instrumented artifacts of the build before
# beside the new ones (ten ~160 MB target binaries and the crates' rlibs: ~1.7 GB), and cargo never
# removes them: 19 GB here after a week of commits, on the disk the test suite's datasets need.
# Only the newest build of the project's own crates and targets is kept; dependencies are left
# alone (one crate may rightly be built twice, with different features, and they rarely change).
prune_stale() {
  local deps name newest hash f
  for deps in "$target_dir"/*/release/deps; do
    [ -d "$deps" ] || continue
    for name in "${all_targets[@]}" {lib,}shardstream{,_proto,_client,_fabric,_fuzz}; do
      newest=$(ls -t "$deps/$name"-* 2>/dev/null | head -n 1) || true
      [ -n "$newest" ] || continue
      hash=$(basename "$newest" | sed -E "s/^$name-([0-9a-f]{16}).*/\1/")
      for f in "$deps/$name"-*; do
        case $(basename "$f") in "$name-$hash"*) ;; *) rm -f "$f" ;; esac
      done
    done
  done
}
mapfile -t all_targets < <(ls fuzz/fuzz_targets | sed -n 's/\.rs$//p')
prune_stale
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  echo "==> fuzz: $t for ${seconds}s"
  log="$target_dir/fuzz-$t.log"
  status=0
  cargo +"$toolchain" fuzz run --fuzz-dir fuzz --sanitizer none --debug-assertions --target-dir "$target_dir" "$t" \
    "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
    -max_total_time="$seconds" -malloc_limit_mb=256 -rss_limit_mb=2048 -timeout=10 \
    -artifact_prefix="fuzz/artifacts/$t/" -print_final_stats=1 >"$log" 2>&1 || status=$?
  # libFuzzer's progress lines stay in the log; the summary and any finding are printed.
  grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb|==[0-9]+== ERROR|SUMMARY|Test unit written|MS: )" "$log" || true
  # parquet_row_group lets arrow-rs panic on damaged page data inside the daemon's catch_unwind
  # (an error to the client); those are counted, not printed one by one.
  caught=$(grep -c "^panicked at " "$log" || true)
  if [ "$status" -eq 0 ] && [ "$caught" -gt 0 ]; then
    echo "fuzz: $t: $caught panics caught inside the daemon's decoder, each an error (grep -A1 \"^panicked at\" $log)"
  fi
  if [ "$status" -ne 0 ]; then
    tail -n 30 "$log"
    echo "fuzz: $t FAILED: the input is in fuzz/artifacts/$t/ (replay: cargo +$toolchain fuzz run --fuzz-dir fuzz -s none $t <file>)"
    exit 1
  fi
done
echo "fuzz: ${#targets[@]} targets ran ${seconds}s each under libFuzzer without a finding"
