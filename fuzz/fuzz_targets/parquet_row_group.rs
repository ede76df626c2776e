#![no_main]

libfuzzer_sys::fuzz_target!(
    init: {
        // libfuzzer-sys aborts on every panic, even one the daemon catches: arrow-rs asserts on
        // some malformed pages and the decode path turns that into an error (`no_panic`). Back to
        // the default hook, so only a panic that escapes the target (libfuzzer-sys catches it
        // and aborts) is a finding.
        drop(std::panic::take_hook());
    },
    |data: &[u8]| shardstream_fuzz::parquet_row_group(data)
);
