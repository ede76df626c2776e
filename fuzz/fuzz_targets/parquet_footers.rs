#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| shardstream_fuzz::parquet_footers(data));
