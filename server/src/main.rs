//! The `shardstream` binary: the command line only; everything else lives in the library.

fn main() {
    std::process::exit(shardstream::cli::main_with_args(std::env::args_os()));
}
