//! How far the opens in progress have come: a dataset without a manifest is opened by indexing
//! each of its shards (a header scan of every TAR shard, read whole through the node cache on S3;
//! a footer read per Parquet file), which takes minutes for a large one. `shardstream prefetch`
//! shows it ([`progress`]) instead of a silent wait.
//!
//! Opens register here for as long as they index ([`Opening::begin`]); a reader looks them up by
//! URL. The set holds only the opens in flight, a handful at most, so a scan of it is the lookup.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};

/// An open in progress: its dataset's URL and how many of its shards are indexed.
#[derive(Debug)]
pub struct Opening {
    url: String,
    total: u64,
    done: AtomicU64,
}

/// The opens in flight (weak: an open's guard is what keeps it listed).
static OPENINGS: Mutex<Vec<Weak<Opening>>> = Mutex::new(Vec::new());

fn openings() -> std::sync::MutexGuard<'static, Vec<Weak<Opening>>> {
    OPENINGS.lock().unwrap_or_else(|p| p.into_inner())
}

impl Opening {
    /// Lists the open of `url`, which indexes `total` shards, until the returned guard drops.
    pub fn begin(url: &str, total: usize) -> Arc<Opening> {
        let o = Arc::new(Opening { url: url.to_owned(), total: total as u64, done: AtomicU64::new(0) });
        let mut list = openings();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(&o));
        o
    }

    /// Notes one more shard indexed.
    pub fn shard_done(&self) {
        self.done.fetch_add(1, Relaxed);
    }
}

/// `(shards indexed, shards to index)` of the open of `url` in flight, if one is indexing.
pub fn progress(url: &str) -> Option<(u64, u64)> {
    openings().iter().filter_map(Weak::upgrade).find(|o| o.url == url).map(|o| (o.done.load(Relaxed), o.total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_is_listed_with_its_count_while_its_guard_lives() {
        let url = "/data/opening-test-listed";
        assert_eq!(progress(url), None);
        let o = Opening::begin(url, 3);
        o.shard_done();
        o.shard_done();
        assert_eq!(progress(url), Some((2, 3)));
        assert_eq!(progress("/data/opening-test-other"), None);
        drop(o);
        assert_eq!(progress(url), None);
    }
}
