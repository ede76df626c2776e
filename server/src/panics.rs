//! Where panics go: the daemon's panic hook, and [`catch`] for the dependencies known to panic on
//! damaged input.
//!
//! arrow-rs asserts (panics) on some malformed Parquet pages and metadata. The decoder runs under
//! [`catch`], which turns such a panic into an error that names the place in the dependency that
//! gave up; the caller adds the file and serves a `ShardError`. Rust's default hook would first
//! print "thread ... panicked at" (and, with `RUST_BACKTRACE` set, a backtrace of 70 frames) to
//! stderr for a panic that was expected and handled, which reads like a crash to an operator and
//! breaks `--log-format json`'s one object per line. [`install_hook`] replaces it: a panic under
//! [`catch`] prints nothing (its error is logged where it is handled, with the file's name), and
//! any other panic, a bug, is one `error` event of target `shardstream::panic` with its thread,
//! place, message and, when `RUST_BACKTRACE` asks for one, its backtrace. Before a subscriber is
//! installed, or with errors filtered out, the default hook prints it as usual: a bug is never
//! silent. So in a process that is not the daemon's own and never installs a subscriber (the
//! Python package's embedded daemon runs inside the trainer) the same hook only keeps caught
//! panics quiet and leaves every other one to the hook the process had.

use std::any::Any;
use std::backtrace::{Backtrace, BacktraceStatus};
use std::cell::{Cell, RefCell};
use std::fmt;
use std::panic::{AssertUnwindSafe, PanicHookInfo};

thread_local! {
    /// How many [`catch`] calls this thread is inside of.
    static CATCHING: Cell<u32> = const { Cell::new(0) };
    /// The place of the last panic the hook saw under [`catch`] on this thread.
    static CAUGHT_AT: RefCell<Option<String>> = const { RefCell::new(None) };
    /// Set while the hook logs, so that a panic inside the subscriber falls back to the default
    /// hook instead of recursing.
    static IN_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// A panic [`catch`] stopped: its message and, when the daemon's hook is installed, where it was
/// raised (`crate-version/src/file.rs:line` for a dependency).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caught {
    pub message: String,
    pub place: Option<String>,
}

impl fmt::Display for Caught {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.place {
            Some(place) => write!(f, "{} (at {place})", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// Runs `f`, turning a panic inside it into a [`Caught`] that the hook does not report: for code
/// that is known to panic on bad input and whose caller reports the failure as an error.
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, Caught> {
    let _ = CAUGHT_AT.try_with(|c| c.borrow_mut().take());
    let _ = CATCHING.try_with(|c| c.set(c.get() + 1));
    let out = std::panic::catch_unwind(AssertUnwindSafe(f));
    let _ = CATCHING.try_with(|c| c.set(c.get().saturating_sub(1)));
    out.map_err(|payload| Caught {
        message: message(payload.as_ref()).unwrap_or("a panic without a message").to_owned(),
        place: CAUGHT_AT.try_with(|c| c.borrow_mut().take()).ok().flatten(),
    })
}

/// A panic payload's message: a `&str` or `String` (what `panic!` makes), else `None`.
pub fn message(payload: &(dyn Any + Send)) -> Option<&str> {
    (payload.downcast_ref::<&str>().copied()).or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

/// `file:line`, shortened for a file of a crate from a registry (`~/.cargo/registry/src/<index>/`
/// dropped): the crate's name and version stay, which is what a report upstream needs.
pub fn place(file: &str, line: u32) -> String {
    let file = file
        .find("/registry/src/")
        .and_then(|i| file[i + "/registry/src/".len()..].split_once('/'))
        .map_or(file, |(_index, in_crate)| in_crate);
    format!("{file}:{line}")
}

/// Replaces the panic hook, keeping the one it replaces for the panics it does not log (see the
/// module docs); the `shardstream` command does at its start, the Python package when it starts
/// an embedded daemon. Calling it again does nothing.
pub fn install_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| hook(info, &default)));
    });
}

type Hook = dyn Fn(&PanicHookInfo<'_>) + Send + Sync;

/// True for a panic under [`catch`] on this thread, whose place is then recorded for its error.
fn caught(info: &PanicHookInfo<'_>) -> bool {
    if CATCHING.try_with(Cell::get).unwrap_or(0) == 0 {
        return false;
    }
    let place = info.location().map(|l| place(l.file(), l.line()));
    let _ = CAUGHT_AT.try_with(|c| *c.borrow_mut() = place);
    true
}

fn hook(info: &PanicHookInfo<'_>, default: &Hook) {
    if caught(info) {
        return;
    }
    let logged = tracing::dispatcher::has_been_set()
        && tracing::enabled!(target: "shardstream::panic", tracing::Level::ERROR)
        && !IN_HOOK.try_with(|h| h.replace(true)).unwrap_or(true);
    if !logged {
        return default(info);
    }
    let thread = std::thread::current();
    let thread = thread.name().unwrap_or("unnamed");
    let message = message(info.payload()).unwrap_or("a panic without a message");
    let at = info.location().map_or_else(|| "unknown".to_owned(), |l| place(l.file(), l.line()));
    let backtrace = Backtrace::capture();
    if backtrace.status() == BacktraceStatus::Captured {
        tracing::error!(target: "shardstream::panic", thread, place = at, %backtrace, "panic: {message}");
    } else {
        tracing::error!(target: "shardstream::panic", thread, place = at, "panic: {message}");
    }
    let _ = IN_HOOK.try_with(|h| h.set(false));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registry_crate_s_place_keeps_its_name_and_version() {
        let file = "/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/arrow-buffer-60.1.0/src/util/x.rs";
        assert_eq!(place(file, 235), "arrow-buffer-60.1.0/src/util/x.rs:235");
        assert_eq!(place("server/src/panics.rs", 7), "server/src/panics.rs:7");
    }

    #[test]
    fn catch_gives_the_message_and_leaves_no_state_behind() {
        let caught = catch(|| -> u8 { panic!("bad page {}", 3) }).unwrap_err();
        assert_eq!(caught.message, "bad page 3");
        assert_eq!(catch(|| 5), Ok(5));
        assert_eq!(CATCHING.with(Cell::get), 0);
        let nested = catch(|| catch(|| -> u8 { panic!("inner") })).unwrap();
        assert_eq!(nested.unwrap_err().message, "inner");
        assert_eq!(CATCHING.with(Cell::get), 0);
    }

    #[test]
    fn with_the_hook_a_caught_panic_says_where_it_was_raised() {
        install_hook();
        let caught = catch(|| -> u8 { panic!("offset + len out of bounds") }).unwrap_err();
        let place = caught.place.as_deref().unwrap_or_default();
        assert!(place.starts_with("server/src/panics.rs:"), "{caught:?}");
        assert_eq!(caught.to_string(), format!("offset + len out of bounds (at {place})"));
    }
}
