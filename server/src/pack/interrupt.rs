//! What `shardstream pack` says when Ctrl-C (SIGINT) or SIGTERM stops it: the journal already
//! makes every moment of a pack resumable, so the signal still ends the process at once, as it
//! would without a handler, but first the user reads how to finish the pack.

use std::sync::OnceLock;

/// The line the handler writes, formatted before the handler is installed: a signal handler
/// may not allocate.
static MESSAGE: OnceLock<Box<[u8]>> = OnceLock::new();

extern "C" fn on_signal(signal: libc::c_int) {
    if let Some(message) = MESSAGE.get() {
        // SAFETY: write(2) is async-signal-safe, and `message` is a static allocation never
        // freed or changed once set (it is set before the handler is installed). A short or
        // failed write loses only the message.
        unsafe { libc::write(libc::STDERR_FILENO, message.as_ptr().cast(), message.len()) };
    }
    // SAFETY: signal(2) and raise(3) are async-signal-safe. With the default action back, the
    // signal raised again ends the process by that signal (exit status 130 for Ctrl-C in a
    // shell), so a script or a job scheduler sees a pack stopped by a signal, as before.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

/// Installs the handler for SIGINT and SIGTERM, which writes `message` (a line of its own) to
/// standard error and then lets the signal end the process. A signal ignored when the pack
/// started stays ignored: a shell ignores SIGINT in the jobs it starts in the background, and
/// `nohup` or a supervisor may ignore others, so that the terminal's Ctrl-C leaves them running.
pub fn tell_on_interrupt(message: &str) -> std::io::Result<()> {
    // A second call keeps the first message: one pack per process.
    let _ = MESSAGE.set(format!("\n{message}\n").into_bytes().into_boxed_slice());
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: sigaction only reads `action` and writes `before`, both valid zeroed structs
        // (a zeroed sigaction has no flags, and its mask is emptied before use); the handler
        // calls only async-signal-safe functions.
        let result = unsafe {
            let mut before: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut before) != 0 {
                -1
            } else if before.sa_sigaction == libc::SIG_IGN {
                0
            } else {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(signal, &action, std::ptr::null_mut())
            }
        };
        if result != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
