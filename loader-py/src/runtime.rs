//! The per-process tokio runtime, re-created after fork.
//!
//! A runtime's worker threads do not exist in a forked child, and dropping the parent's copy there
//! could block forever joining them. So the runtime is leaked (it lives as long as the process
//! anyway) and keyed by pid: a child that asks for it gets a fresh one and never touches the
//! inherited copy.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, Ordering};

use pyo3::prelude::*;

use crate::SIGNAL_CHECK;

/// Runtime threads: two are plenty for a client (decode + socket), and the embedded daemon does
/// its disk reads on the blocking pool, which grows on demand.
const WORKER_THREADS: usize = 2;

/// The current process's runtime and its pid. Read without a lock: a parent thread holding a
/// lock at the moment of fork would leave it held for ever in the child, and every blocked call
/// asks for the runtime several times a second.
static RUNTIME: AtomicPtr<(u32, tokio::runtime::Runtime)> = AtomicPtr::new(std::ptr::null_mut());

/// Serialises the creation of a runtime (once per process).
static CREATE: Mutex<()> = Mutex::new(());

fn current(pid: u32) -> Option<&'static tokio::runtime::Runtime> {
    let p = RUNTIME.load(Ordering::Acquire);
    // SAFETY: a non-null pointer came from `Box::leak` below and is never freed.
    let (owner, rt) = unsafe { p.as_ref() }?;
    (*owner == pid).then_some(rt)
}

pub fn runtime() -> &'static tokio::runtime::Runtime {
    let pid = std::process::id();
    if let Some(rt) = current(pid) {
        return rt;
    }
    let _creating = CREATE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(rt) = current(pid) {
        return rt;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .thread_name("shardstream")
        .enable_all()
        .build()
        // Creating a runtime fails only when the OS refuses threads or an epoll fd: nothing a
        // caller could recover from.
        .expect("cannot start the shardstream runtime (out of threads or file descriptors?)");
    // Leaked: the runtime lives as long as the process, and a child must never drop its parent's.
    let leaked: &'static (u32, tokio::runtime::Runtime) = Box::leak(Box::new((pid, rt)));
    RUNTIME.store(std::ptr::from_ref(leaked).cast_mut(), Ordering::Release);
    &leaked.1
}

/// Runs `fut` to completion with the GIL released, waking every [`SIGNAL_CHECK`] so Python can
/// handle signals. When a signal handler raises (Ctrl-C -> KeyboardInterrupt), the future is
/// dropped (which cancels the request or stream) and the exception is returned.
pub fn block_on<F>(py: Python<'_>, fut: F) -> PyResult<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime();
    let mut fut = Box::pin(fut);
    loop {
        let r = py.detach(|| rt.block_on(async { tokio::time::timeout(SIGNAL_CHECK, &mut fut).await }));
        match r {
            Ok(v) => return Ok(v),
            Err(_) => py.check_signals()?,
        }
    }
}
