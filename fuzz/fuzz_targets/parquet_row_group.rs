#![no_main]

libfuzzer_sys::fuzz_target!(
    init: {
        // libfuzzer-sys aborts on every panic, even one the daemon catches: arrow-rs asserts on
        // some malformed pages and the decode path turns that into an error (`no_panic`). A hook
        // that only prints where and why, so only a panic that escapes the target (libfuzzer-sys
        // catches it and aborts) is a finding. Not the default hook: `cargo fuzz` sets
        // RUST_BACKTRACE, and a backtrace for each of the thousands of caught panics buried the
        // log (the run's speed was the same: ~10,200 runs/s either way).
        std::panic::set_hook(Box::new(|info| eprintln!("{info}")));
    },
    |data: &[u8]| shardstream_fuzz::parquet_row_group(data)
);
