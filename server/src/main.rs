//! The `shardstream` binary: the command line only; everything else lives in the library.

fn main() {
    // A test build (`--features failpoints`) arms the failpoints FAILPOINTS names; see the
    // library's `failpoints` module. Held until exit: `process::exit` runs no destructor.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    std::process::exit(shardstream::cli::main_with_args(std::env::args_os()));
}
