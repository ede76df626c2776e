//! The fuzz targets (`fuzz/src/lib.rs`) as ordinary tests, for every toolchain: each target runs
//! over its committed seeds (`fuzz/seeds/<target>/`) and over mutations of them (byte flips,
//! boundary values, truncations, splices), deterministic per run so a failure reproduces.
//! `SHARDSTREAM_FUZZ_ITERS` sets the mutations per target (default 20000: a few seconds); a failing
//! input is written to a file named in the failure.
//!
//! Allocation is bounded too: a counting allocator records the largest single request each
//! thread makes, and no input may make a reader ask for more than [`ALLOC_LIMIT`] plus a few
//! times its own size.

#[path = "../../fuzz/src/lib.rs"]
mod harness;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

/// Largest single allocation any input may cause, beyond 8 x its own length: the TAR reader's
/// caps (64 KiB names, 1 MiB PAX records) with room to spare.
const ALLOC_LIMIT: usize = 4 << 20;

struct Counting;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    /// Panics on this thread, caught or not, and the last one's message.
    static PANICS: Cell<usize> = const { Cell::new(0) };
    static LAST_PANIC: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// Targets whose code under test may panic inside and catch it: the row-group decoder (arrow-rs
/// asserts on some damaged pages; the daemon turns that into an error with `no_panic`). In every
/// other target a caught panic is a finding too, as it is under libFuzzer.
const CAUGHT_PANICS_ALLOWED: &[&str] = &["parquet_row_group"];

fn note(size: usize) {
    // `try_with`: the slot is gone while the thread's locals are being destroyed.
    let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so `System`'s
// guarantees hold; the only addition is a thread-local `Cell` update, which neither allocates (a
// const-initialised local without destructor) nor touches the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn seeds(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds").join(target);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let p = e.unwrap().path();
            (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no seeds in {}", dir.display());
    out
}

/// Runs `f` on `input`; a panic or an oversized allocation fails the test, naming a file that
/// holds the input (`cargo fuzz run <target> <file>` replays it under libFuzzer).
fn run_one(target: &str, f: harness::Target, input: &[u8], what: &str) {
    LARGEST.with(|l| l.set(0));
    PANICS.with(|p| p.set(0));
    let outcome = catch_unwind(AssertUnwindSafe(|| f(input)));
    let largest = LARGEST.with(Cell::get);
    let caught = PANICS.with(Cell::get) > 0 && !CAUGHT_PANICS_ALLOWED.contains(&target);
    let limit = ALLOC_LIMIT + 8 * input.len();
    let failure = match outcome {
        Err(e) => Some(
            e.downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "panic".into()),
        ),
        Ok(()) if caught => Some(format!("a panic caught inside: {}", LAST_PANIC.with(|l| l.borrow().clone()))),
        Ok(()) if largest > limit => Some(format!("allocated {largest} bytes at once (limit {limit})")),
        Ok(()) => None,
    };
    if let Some(why) = failure {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures").join(target);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join(format!("{:016x}", crc32c::crc32c(input)));
        std::fs::write(&file, input).unwrap();
        panic!("{target} on {what} ({} bytes, saved to {}): {why}", input.len(), file.display());
    }
}

/// Values that sit on the edges of the readers' checks (sizes, counts, octal digits, varints).
const INTERESTING: &[u8] = &[0, 1, 0x7f, 0x80, 0xff, b'0', b'7', b'8', b' ', b'/', b'.', b'x', b'g', b'L'];

fn mutate(rng: &mut fastrand::Rng, seeds: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut data = seeds[rng.usize(..seeds.len())].1.clone();
    for _ in 0..rng.usize(1..=8) {
        let len = data.len();
        match rng.u8(..7) {
            0 if len > 0 => data[rng.usize(..len)] ^= 1 << rng.u8(..8),
            1 if len > 0 => data[rng.usize(..len)] = INTERESTING[rng.usize(..INTERESTING.len())],
            2 if len > 0 => {
                // A little-endian or octal-looking run overwritten at once (sizes, counts).
                let at = rng.usize(..len);
                let fill = if rng.bool() { 0xff } else { b'7' };
                for b in data.iter_mut().skip(at).take(rng.usize(1..=12)) {
                    *b = fill;
                }
            }
            3 => data.truncate(rng.usize(..=len)),
            4 if len > 0 => {
                // Splice in a piece of another seed (another header in the middle of this one).
                let other = &seeds[rng.usize(..seeds.len())].1;
                if !other.is_empty() {
                    let from = rng.usize(..other.len());
                    let n = rng.usize(1..=(other.len() - from).min(600));
                    let at = rng.usize(..=len);
                    data.splice(at..at, other[from..from + n].iter().copied());
                }
            }
            5 if len >= 512 => {
                // Drop or repeat a 512-byte block (TAR structure).
                let at = rng.usize(..len / 512) * 512;
                if rng.bool() {
                    data.drain(at..at + 512);
                } else {
                    let block = data[at..at + 512].to_vec();
                    data.splice(at..at, block);
                }
            }
            _ => data.push(rng.u8(..)),
        }
    }
    data
}

fn run_target(target: &str) {
    // Every panic is counted (`run_one` fails a target on one caught inside, unless it is in
    // `CAUGHT_PANICS_ALLOWED`) and printed with its place, without a backtrace: the row-group
    // target's decoder panics on some damaged pages inside the daemon's `catch_unwind`, and a
    // backtrace's symbolisation (`RUST_BACKTRACE=1`) would be the largest allocation counted.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            eprintln!("{info}");
            let _ = PANICS.try_with(|p| p.set(p.get() + 1));
            let _ = LAST_PANIC.try_with(|l| *l.borrow_mut() = info.to_string());
        }))
    });
    let f = harness::TARGETS.iter().find(|(n, _)| *n == target).map(|(_, f)| *f).unwrap();
    let seeds = seeds(target);
    for (name, data) in &seeds {
        run_one(target, f, data, &format!("seed {name}"));
    }
    let iters: u64 = std::env::var("SHARDSTREAM_FUZZ_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let mut rng = fastrand::Rng::with_seed(0x5eed ^ crc32c::crc32c(target.as_bytes()) as u64);
    for i in 0..iters {
        let input = mutate(&mut rng, &seeds);
        run_one(target, f, &input, &format!("mutation {i}"));
    }
}

#[test]
fn every_target_has_seeds_and_a_test() {
    let names: Vec<&str> = harness::TARGETS.iter().map(|(n, _)| *n).collect();
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    for n in &names {
        assert!(!seeds(n).is_empty());
        assert!(fuzz.join("fuzz_targets").join(format!("{n}.rs")).is_file(), "no fuzz_targets/{n}.rs");
    }
    let this = include_str!("fuzz_targets.rs");
    for n in &names {
        assert!(this.contains(&format!("fn {n}() {{")), "no test for target {n}");
    }
}

#[test]
fn tar_index() {
    run_target("tar_index");
}

#[test]
fn tar_sample() {
    run_target("tar_sample");
}

#[test]
fn sidecar() {
    run_target("sidecar");
}

#[test]
fn manifest() {
    run_target("manifest");
}

#[test]
fn shm_frame() {
    run_target("shm_frame");
}

#[test]
fn ring() {
    run_target("ring");
}

#[test]
fn journal() {
    run_target("journal");
}

/// The allocation bound is a real check: a body that allocates 64 MiB for a 1-byte input fails.
#[test]
fn the_allocation_bound_catches_an_oversized_allocation() {
    fn greedy(data: &[u8]) {
        let v = vec![0u8; (64 << 20) + data.len()];
        std::hint::black_box(&v);
    }
    let err = catch_unwind(|| run_one("alloc_probe", greedy, b"x", "a probe")).unwrap_err();
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("allocated 67108865 bytes at once"), "{msg}");
}

#[test]
fn parquet_footer() {
    run_target("parquet_footer");
}

#[test]
fn parquet_footers() {
    run_target("parquet_footers");
}

#[test]
fn parquet_row_group() {
    run_target("parquet_row_group");
}
