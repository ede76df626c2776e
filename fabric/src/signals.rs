//! The process's signal handlers, kept across loading libfabric.
//!
//! Debian's and RHEL's libfabric link the PSM provider's libinfinipath, whose constructor (run by
//! `dlopen`) installs one handler for SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT that
//! prints a backtrace and calls `exit(1)`. Left in place, a trainer that builds an rdma loader
//! loses Ctrl-C (no `KeyboardInterrupt`, no `finally`, no checkpoint) and its own SIGTERM
//! handler, and `serve --rdma` exits 1 on SIGTERM without draining. Nothing in libfabric needs
//! those handlers: [`keeping_handlers`] puts back whatever the process had before.

use std::ffi::{c_int, c_void};

/// Runs `load` and then restores every catchable signal's disposition that it changed. A handler
/// this crate's own object file installed meanwhile (the daemon's or the client's signal handling,
/// from another thread) is left in place: only what another library put there is undone. But one
/// installed meanwhile and then replaced by the library is lost (the restore writes back what was
/// there before it): a process installs its handlers before anything loads libfabric, as
/// `shardstream serve` does.
pub(crate) fn keeping_handlers<T>(load: impl FnOnce() -> T) -> T {
    let before: Vec<(c_int, libc::sigaction)> =
        (1..libc::SIGRTMIN()).filter(|&s| catchable(s)).filter_map(|s| current(s).map(|a| (s, a))).collect();
    let out = load();
    for (signal, old) in before {
        let Some(now) = current(signal) else { continue };
        if now.sa_sigaction == old.sa_sigaction || installed_by_us(now.sa_sigaction) {
            continue;
        }
        // SAFETY: `old` is the disposition `sigaction` reported for `signal` before `load`: a
        // handler (or SIG_DFL / SIG_IGN) of this process with its own mask and flags.
        unsafe { libc::sigaction(signal, &old, std::ptr::null_mut()) };
    }
    out
}

fn catchable(signal: c_int) -> bool {
    signal != libc::SIGKILL && signal != libc::SIGSTOP
}

/// The current disposition of `signal` (its handler, mask and flags), or None when `sigaction`
/// refuses to tell (not a signal number).
pub fn current(signal: c_int) -> Option<libc::sigaction> {
    let mut action = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: a null new action only reads the current one into `action`, which lives for the call.
    if unsafe { libc::sigaction(signal, std::ptr::null(), action.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: zero-initialised, then filled by a successful call; every field is plain data.
    Some(unsafe { action.assume_init() })
}

/// Whether `handler` is code of the object file (executable or shared library) this function is in.
fn installed_by_us(handler: libc::sighandler_t) -> bool {
    let base = |addr: *const c_void| {
        let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
        // SAFETY: dladdr only reads the address and fills `info`, which lives for the call.
        let found = unsafe { libc::dladdr(addr, info.as_mut_ptr()) } != 0;
        // SAFETY: filled by a successful call (zeroes otherwise); `dli_fbase` is a plain pointer.
        found.then(|| unsafe { info.assume_init() }.dli_fbase)
    };
    let ours = base(installed_by_us as *const c_void);
    handler > libc::SIG_IGN && ours.is_some() && base(handler as *const c_void) == ours
}

#[cfg(test)]
mod tests {
    use super::*;

    extern "C" fn our_handler(_: c_int) {}

    #[test]
    fn a_handler_installed_while_loading_is_undone_and_ours_is_kept() {
        // SIGUSR2, which nothing else in the test binary handles.
        let before = current(libc::SIGUSR2).expect("sigaction");
        let install = |handler: libc::sighandler_t| {
            let mut a = before;
            a.sa_sigaction = handler;
            // SAFETY: a handler of this test binary (or SIG_IGN), with the old mask and flags.
            unsafe { libc::sigaction(libc::SIGUSR2, &a, std::ptr::null_mut()) };
        };
        // A function of this object file stands for our own handler; SIG_IGN for a library's
        // (a foreign object's address cannot be had without loading one).
        keeping_handlers(|| install(libc::SIG_IGN));
        assert_eq!(current(libc::SIGUSR2).expect("sigaction").sa_sigaction, before.sa_sigaction);
        let ours = our_handler as *const () as libc::sighandler_t;
        keeping_handlers(|| install(ours));
        assert_eq!(current(libc::SIGUSR2).expect("sigaction").sa_sigaction, ours);
        // Ours in place before the load, a library's replacing it: ours is what comes back.
        keeping_handlers(|| install(libc::SIG_IGN));
        assert_eq!(current(libc::SIGUSR2).expect("sigaction").sa_sigaction, ours);
        // SAFETY: puts back what the test found.
        unsafe { libc::sigaction(libc::SIGUSR2, &before, std::ptr::null_mut()) };
    }
}
