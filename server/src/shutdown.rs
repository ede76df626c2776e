//! One shutdown token for the whole daemon: the first SIGTERM or Ctrl-C cancels it (listeners stop
//! accepting, streams end with `UNAVAILABLE`, the process exits once they have drained); a second
//! signal exits at once.

use tokio_util::sync::CancellationToken;

/// Cancels `token` on the first SIGTERM/SIGINT and exits the process on the second.
// Only `shardstream serve` installs these (the embedded server in a trainer does not): exiting is
// what its operator asked for with the second signal.
#[expect(clippy::exit, reason = "the daemon's second signal means exit now")]
pub fn install_signal_handlers(token: CancellationToken) {
    tokio::spawn(async move {
        let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
            tracing::error!("cannot install the SIGTERM handler; shut down with SIGKILL");
            return;
        };
        let mut signals = 0;
        loop {
            tokio::select! {
                _ = term.recv() => {}
                r = tokio::signal::ctrl_c() => if r.is_err() { return },
            }
            signals += 1;
            if signals == 1 {
                tracing::info!("shutdown requested, draining streams (signal again to exit now)");
                token.cancel();
            } else {
                tracing::warn!("second signal, exiting now");
                std::process::exit(130);
            }
        }
    });
}
