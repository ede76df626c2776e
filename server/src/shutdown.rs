//! One shutdown token for the whole daemon: the first SIGTERM or Ctrl-C cancels it (listeners stop
//! accepting, streams end with `UNAVAILABLE`, the process exits once they have drained); a second
//! signal exits at once (status 130), removing the daemon's socket files first.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Cancels `token` on the first SIGTERM/SIGINT and exits the process on the second. Must run in a
/// runtime, before anything that may load libfabric: the handlers are in place when it returns.
// Only `shardstream serve` installs these (the embedded server in a trainer does not): exiting is
// what its operator asked for with the second signal.
//
// Why before: loading libfabric runs a dependency's constructor that takes SIGTERM and SIGINT,
// and the fabric crate then writes back the actions it found before the load. A handler installed
// by another thread in the middle of that load (as a spawned task did, racing `--rdma`'s start-up
// check) was replaced and then reset to the default: the daemon died of its first SIGTERM.
#[expect(clippy::exit, reason = "the daemon's second signal means exit now")]
pub fn install_signal_handlers(token: CancellationToken) {
    // Each on its own: one that cannot be installed leaves the other working.
    let mut term = listen(SignalKind::terminate(), "SIGTERM");
    let mut int = listen(SignalKind::interrupt(), "SIGINT");
    if term.is_none() && int.is_none() {
        return;
    }
    tokio::spawn(async move {
        let mut signals = 0;
        loop {
            tokio::select! {
                Some(()) = async { term.as_mut()?.recv().await } => {}
                Some(()) = async { int.as_mut()?.recv().await } => {}
                else => return,
            }
            signals += 1;
            if signals == 1 {
                tracing::info!("shutdown requested, draining streams (signal again to exit now)");
                token.cancel();
            } else {
                tracing::warn!("second signal, exiting now");
                remove_registered();
                std::process::exit(130);
            }
        }
    });
}

/// Socket files a second signal's exit removes: the drain's end removes them otherwise, and left
/// behind they read as a daemon that refuses connections until the next one replaces them.
static REMOVED_AT_EXIT: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Registers `path` (a socket this process bound) for removal at a second signal's exit.
pub fn remove_at_forced_exit(path: &Path) {
    REMOVED_AT_EXIT.lock().unwrap_or_else(|p| p.into_inner()).push(path.to_owned());
}

/// Forgets the registered socket files: removed by the drain's end, their paths may be bound by
/// another daemon while this one syncs its cache and exits.
pub fn forget_registered() {
    REMOVED_AT_EXIT.lock().unwrap_or_else(|p| p.into_inner()).clear();
}

fn remove_registered() {
    for path in REMOVED_AT_EXIT.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        let _ = std::fs::remove_file(path);
    }
}

fn listen(kind: SignalKind, name: &str) -> Option<Signal> {
    signal(kind)
        .map_err(|e| tracing::error!("cannot install the {name} handler ({e}): it will not drain the daemon"))
        .ok()
}
