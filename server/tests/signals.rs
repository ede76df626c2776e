//! The daemon's signal handlers are in place when `install_signal_handlers` returns, before
//! `serve` goes on to anything that may load libfabric (`--rdma`'s start-up check).
//!
//! Loading libfabric runs its PSM dependency's constructor, which takes SIGTERM and SIGINT with a
//! handler that exits 1; the fabric crate puts back what the process had before the load. A
//! handler the daemon installed from another thread *during* that load was then lost: the
//! library's replaced it, and the restore wrote back the default action, so the daemon died of
//! its first SIGTERM (exit -15 instead of a drain). Installed before the load, it is what the
//! restore puts back. Its own test binary: the handlers stay for the life of the process.

use std::ffi::c_int;

use tokio_util::sync::CancellationToken;

fn handler_of(signal: c_int) -> libc::sighandler_t {
    shardstream_fabric::signal_disposition(signal).unwrap_or_else(|| panic!("sigaction({signal}) failed")).sa_sigaction
}

#[test]
fn the_handlers_are_in_place_when_installing_returns() {
    // SIG_IGN is what a shell's background job inherits for SIGINT; a handler is what counts.
    let no_handler = |h: libc::sighandler_t| h == libc::SIG_DFL || h == libc::SIG_IGN;
    for signal in [libc::SIGTERM, libc::SIGINT] {
        assert!(no_handler(handler_of(signal)), "signal {signal} handled before the test");
    }
    // One thread: a task spawned to install them would not have run before the checks below.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async {
        shardstream::shutdown::install_signal_handlers(CancellationToken::new());
        for signal in [libc::SIGTERM, libc::SIGINT] {
            assert!(!no_handler(handler_of(signal)), "signal {signal}: no handler yet");
        }
    });
}
