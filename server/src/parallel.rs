//! A tiny scoped thread pool for per-shard work (header scans, checksums): maps a slice in order,
//! stops handing out work after the first failure, and reports the first failure in slice order,
//! so errors are deterministic whichever thread hit one first.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{Error, Result};

/// Applies `f` to every item on up to `threads` threads; results come back in `items` order.
pub fn try_map<I: Sync, T: Send>(items: &[I], threads: usize, f: impl Fn(&I) -> Result<T> + Sync) -> Result<Vec<T>> {
    let next = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<Result<T>>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, items.len().max(1)) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    let r = f(item);
                    let failed = r.is_err();
                    slots.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
                    if failed {
                        next.store(items.len(), Ordering::Relaxed);
                    }
                }
            });
        }
    });
    // Items before a failure were all handed out, so they are done: the first non-Ok slot in
    // order is a real failure, not an item skipped because of one.
    slots
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Internal("parallel work did not finish".into()))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_order_and_reports_the_first_failure() {
        let items: Vec<u32> = (0..100).collect();
        assert_eq!(try_map(&items, 4, |&i| Ok(i * 2)).unwrap(), items.iter().map(|i| i * 2).collect::<Vec<_>>());
        let err = try_map(&items, 4, |&i| if i >= 40 { Err(Error::invalid(format!("bad {i}"))) } else { Ok(i) });
        assert_eq!(err.unwrap_err().to_string(), "bad 40");
        assert!(try_map(&[] as &[u32], 4, |&i| Ok(i)).unwrap().is_empty());
    }
}
