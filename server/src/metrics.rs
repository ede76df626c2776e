//! Daemon-wide counters, in one place. Updated per batch, per request or per shard, never per
//! sample, with relaxed atomics: they are statistics, not synchronisation. `status` reads the
//! atomics; `serve --metrics-addr` exports the same numbers to Prometheus through the `metrics`
//! facade (without an exporter installed those calls cost next to nothing).
//!
//! Names follow `shardstream_<what>_<unit>[_total]`; labels are bounded sets (backend, request
//! kind, rank and worker of a consumer on this node), never keys, paths or error texts.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Storage counters since start-up (also exported): bytes, requests and retries to S3.
pub static STORAGE_BYTES: AtomicU64 = AtomicU64::new(0);
pub static STORAGE_REQUESTS: AtomicU64 = AtomicU64::new(0);
pub static STORAGE_RETRIES: AtomicU64 = AtomicU64::new(0);

/// Metadata calls made on local and parallel file systems since start-up: directory listings and
/// `stat`s (dataset discovery, revalidation). The per-thread copies let a test count the calls
/// one open makes while other tests run.
pub static LOCAL_LISTS: AtomicU64 = AtomicU64::new(0);
pub static LOCAL_STATS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD_LOCAL_METADATA: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
}

/// (listings, stats) made by the calling thread so far.
pub fn thread_local_metadata_calls() -> (u64, u64) {
    THREAD_LOCAL_METADATA.with(|c| c.get())
}

pub fn local_list(n: u64) {
    LOCAL_LISTS.fetch_add(n, Relaxed);
    THREAD_LOCAL_METADATA.with(|c| c.set((c.get().0 + n, c.get().1)));
    metrics::counter!("shardstream_local_lists_total").increment(n);
}

pub fn local_stat(n: u64) {
    LOCAL_STATS.fetch_add(n, Relaxed);
    THREAD_LOCAL_METADATA.with(|c| c.set((c.get().0, c.get().1 + n)));
    metrics::counter!("shardstream_local_stats_total").increment(n);
}

pub fn dataset_open() {
    metrics::counter!("shardstream_dataset_opens_total").increment(1);
}

pub fn dataset_open_coalesced() {
    metrics::counter!("shardstream_dataset_opens_coalesced_total").increment(1);
}

pub fn dataset_build() {
    metrics::counter!("shardstream_dataset_builds_total").increment(1);
}

pub fn dataset_eviction() {
    metrics::counter!("shardstream_dataset_evictions_total").increment(1);
}

pub fn datasets_registered(n: u64) {
    metrics::gauge!("shardstream_datasets_registered").set(n as f64);
}

/// Bytes reserved against `--packed-budget` or `--rdma-budget`, after a change.
pub fn budget_bytes(pool: crate::transport::budget::Pool, in_use: u64) {
    use crate::transport::budget::Pool;
    let gauge = match pool {
        Pool::PackedRings => metrics::gauge!("shardstream_packed_budget_used_bytes"),
        Pool::RdmaStaging => metrics::gauge!("shardstream_rdma_budget_used_bytes"),
    };
    gauge.set(in_use as f64);
}

/// The memory budgets' bounds (`--packed-budget`; `--rdma-budget`, 0 without rdma, as `status`
/// says; `--inline-budget`) and their use at 0, set as the exporter starts, before any stream:
/// a use gauge is otherwise first set when something is held, and a dashboard read "No data"
/// where it should read 0 against its bound.
pub fn budgets(packed: u64, rdma: u64, inline: u64) {
    for (bound, used, bytes) in [
        ("shardstream_packed_budget_bytes", "shardstream_packed_budget_used_bytes", packed),
        ("shardstream_rdma_budget_bytes", "shardstream_rdma_budget_used_bytes", rdma),
        ("shardstream_inline_budget_bytes", "shardstream_inline_queued_bytes", inline),
    ] {
        metrics::gauge!(bound).set(bytes as f64);
        metrics::gauge!(used).set(0.0);
    }
}

/// Bytes of inline batches queued for clients (`--inline-budget`), after a change.
pub fn inline_queued_bytes(bytes: u64) {
    metrics::gauge!("shardstream_inline_queued_bytes").set(bytes as f64);
}

/// Starts the Prometheus endpoint (`GET /metrics` on `addr`). Needs a tokio runtime.
pub fn install_exporter(addr: SocketAddr) -> crate::Result<()> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| crate::Error::Unavailable(format!("cannot serve metrics on {addr}: {e}")))?;
    describe();
    publish_counters_at_zero();
    Ok(())
}

/// Counters a scrape shows from the start, at 0. A series the facade has not seen yet is absent,
/// and a dashboard's rate or ratio over it (evictions, retries per request) reads "No data" where
/// it should read 0. `increment(0)` registers the series without touching a count already made.
fn publish_counters_at_zero() {
    for name in [
        "shardstream_cache_hits_total",
        "shardstream_cache_misses_total",
        "shardstream_cache_evictions_total",
        "shardstream_local_lists_total",
        "shardstream_local_stats_total",
        "shardstream_dataset_opens_total",
        "shardstream_dataset_opens_coalesced_total",
        "shardstream_dataset_builds_total",
        "shardstream_dataset_evictions_total",
        "shardstream_samples_served_total",
        "shardstream_bytes_served_total",
    ] {
        metrics::counter!(name).increment(0);
    }
    // Retries are labelled by backend, and only S3 retries.
    metrics::counter!("shardstream_storage_retries_total", "backend" => "s3").increment(0);
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge};
    describe_counter!("shardstream_storage_bytes_total", Unit::Bytes, "bytes read from remote storage");
    describe_counter!("shardstream_storage_requests_total", "requests sent to remote storage");
    describe_counter!("shardstream_storage_retries_total", "remote storage requests retried");
    describe_counter!("shardstream_cache_hits_total", "shard lookups served from the node cache");
    describe_counter!("shardstream_cache_misses_total", "shard lookups that had to fetch the shard");
    describe_counter!("shardstream_cache_evictions_total", "shards evicted from the node cache");
    describe_gauge!("shardstream_cache_bytes", Unit::Bytes, "bytes held by the node cache");
    describe_gauge!("shardstream_cache_capacity_bytes", Unit::Bytes, "capacity of the node cache");
    describe_gauge!(
        "shardstream_prefetch_horizon_seconds",
        Unit::Seconds,
        "seconds of data cached ahead of the slowest-served consumer"
    );
    describe_gauge!(
        "shardstream_prefetch_consumers",
        "streams reading through the node cache, which the prefetcher serves (the horizon's consumers)"
    );
    // A gauge only because the facade's counters are integers; it only ever grows.
    describe_gauge!(
        "shardstream_consumer_wait_seconds_total",
        Unit::Seconds,
        "time a consumer's stream waited for data (GPU stall)"
    );
    describe_gauge!(
        "shardstream_shm_ring_bytes",
        Unit::Bytes,
        "packed-mode ring segments alive: shared with clients, or kept for a user's next stream"
    );
    describe_counter!("shardstream_local_lists_total", "directory listings of local/PFS datasets");
    describe_counter!("shardstream_local_stats_total", "stat calls on local/PFS datasets and shards");
    describe_counter!("shardstream_dataset_opens_total", "dataset opens asked for");
    describe_counter!("shardstream_dataset_opens_coalesced_total", "opens that waited for a concurrent open");
    describe_counter!("shardstream_dataset_builds_total", "dataset discoveries that built a new index");
    describe_counter!("shardstream_dataset_evictions_total", "datasets dropped from the registry (bounds)");
    describe_gauge!("shardstream_datasets_registered", "datasets held by the registry");
    describe_gauge!(
        "shardstream_packed_budget_used_bytes",
        Unit::Bytes,
        "packed ring bytes reserved against --packed-budget"
    );
    describe_gauge!(
        "shardstream_rdma_budget_used_bytes",
        Unit::Bytes,
        "rdma staging bytes (registered memory) reserved against --rdma-budget"
    );
    describe_gauge!(
        "shardstream_inline_queued_bytes",
        Unit::Bytes,
        "inline batch bytes queued for clients, bounded by --inline-budget"
    );
    describe_gauge!("shardstream_packed_budget_bytes", Unit::Bytes, "the bound on packed ring bytes (--packed-budget)");
    describe_gauge!(
        "shardstream_rdma_budget_bytes",
        Unit::Bytes,
        "the bound on rdma staging bytes (--rdma-budget; 0 without rdma)"
    );
    describe_gauge!(
        "shardstream_inline_budget_bytes",
        Unit::Bytes,
        "the bound on inline batch bytes queued for clients (--inline-budget)"
    );
    describe_gauge!(
        "shardstream_parquet_decoded_bytes",
        Unit::Bytes,
        "decoded Parquet row groups held in memory for the streams' windows"
    );
    describe_gauge!(
        "shardstream_parquet_decoded_budget_bytes",
        Unit::Bytes,
        "the bound on decoded Parquet row groups in memory (--decoded-budget)"
    );
    describe_counter!("shardstream_samples_served_total", "samples delivered to consumers");
    describe_counter!("shardstream_bytes_served_total", Unit::Bytes, "payload bytes delivered to consumers");
}

pub fn storage_request(backend: &'static str, kind: &'static str) {
    STORAGE_REQUESTS.fetch_add(1, Relaxed);
    metrics::counter!("shardstream_storage_requests_total", "backend" => backend, "kind" => kind).increment(1);
}

pub fn storage_retry(backend: &'static str) {
    STORAGE_RETRIES.fetch_add(1, Relaxed);
    metrics::counter!("shardstream_storage_retries_total", "backend" => backend).increment(1);
}

pub fn storage_bytes(backend: &'static str, n: u64) {
    STORAGE_BYTES.fetch_add(n, Relaxed);
    metrics::counter!("shardstream_storage_bytes_total", "backend" => backend).increment(n);
}

pub fn cache_hit() {
    metrics::counter!("shardstream_cache_hits_total").increment(1);
}

pub fn cache_miss() {
    metrics::counter!("shardstream_cache_misses_total").increment(1);
}

pub fn cache_eviction() {
    metrics::counter!("shardstream_cache_evictions_total").increment(1);
}

pub fn cache_gauges(used: u64, capacity: u64) {
    metrics::gauge!("shardstream_cache_bytes").set(used as f64);
    metrics::gauge!("shardstream_cache_capacity_bytes").set(capacity as f64);
}

/// Bytes of decoded Parquet row groups the daemon keeps, and their bound.
pub fn parquet_decoded(bytes: u64, budget: u64) {
    metrics::gauge!("shardstream_parquet_decoded_bytes").set(bytes as f64);
    metrics::gauge!("shardstream_parquet_decoded_budget_bytes").set(budget as f64);
}

/// Bytes of packed-mode rings alive, after one was made or dropped.
pub fn ring_bytes(bytes: u64) {
    metrics::gauge!("shardstream_shm_ring_bytes").set(bytes as f64);
}

/// The horizon over the `consumers` streams that read through the node cache. Without one (every
/// stream reads in place, or none is open) the horizon is 0, which says nothing: the consumer
/// count tells the alert so.
pub fn prefetch_horizon(seconds: f64, consumers: usize) {
    metrics::gauge!("shardstream_prefetch_horizon_seconds").set(seconds);
    metrics::gauge!("shardstream_prefetch_consumers").set(consumers as f64);
}

/// Time one consumer's stream waited for shard bytes (labels: its rank and DataLoader worker).
pub fn consumer_wait(rank: u32, worker: u32, seconds: f64) {
    metrics::gauge!("shardstream_consumer_wait_seconds_total", "rank" => rank.to_string(), "worker" => worker.to_string())
        .increment(seconds);
}

#[derive(Debug)]
pub struct Metrics {
    started: Instant,
    /// shardstream_streams_active
    pub streams_active: AtomicU64,
    /// shardstream_streams_total
    pub streams_total: AtomicU64,
    /// shardstream_samples_served_total
    pub samples_served: AtomicU64,
    /// shardstream_bytes_served_total
    pub bytes_served: AtomicU64,
    /// shardstream_read_wait_seconds_total (stored in microseconds)
    pub read_wait_us: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            streams_active: AtomicU64::new(0),
            streams_total: AtomicU64::new(0),
            samples_served: AtomicU64::new(0),
            bytes_served: AtomicU64::new(0),
            read_wait_us: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn uptime_ms(&self) -> u64 {
        self.started.elapsed().as_millis().try_into().unwrap_or(u64::MAX)
    }

    pub fn batch_served(&self, samples: u64, bytes: u64) {
        self.samples_served.fetch_add(samples, Relaxed);
        self.bytes_served.fetch_add(bytes, Relaxed);
        metrics::counter!("shardstream_samples_served_total").increment(samples);
        metrics::counter!("shardstream_bytes_served_total").increment(bytes);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Relaxed)
    }
}

/// Counts a stream as active for as long as the guard lives (also when its task is cancelled).
pub struct ActiveStream<'a>(&'a Metrics);

impl<'a> ActiveStream<'a> {
    pub fn new(m: &'a Metrics) -> Self {
        m.streams_active.fetch_add(1, Relaxed);
        m.streams_total.fetch_add(1, Relaxed);
        Self(m)
    }
}

impl Drop for ActiveStream<'_> {
    fn drop(&mut self) {
        self.0.streams_active.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    /// The quoted `shardstream_*` names that follow each `marker` in `text`.
    fn names_after<'t>(text: &'t str, marker: &str) -> Vec<&'t str> {
        text.match_indices(marker)
            .filter_map(|(at, _)| {
                let rest = text[at + marker.len()..].trim_start().strip_prefix('"')?;
                let name = &rest[..rest.find('"')?];
                name.starts_with("shardstream_").then_some(name)
            })
            .collect()
    }

    fn sources(dir: &std::path::Path, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push((path.display().to_string(), std::fs::read_to_string(&path).unwrap()));
            }
        }
    }

    #[test]
    fn every_metric_the_daemon_sets_has_a_help_text() {
        // `promtool check metrics` fails a family without # HELP (exit 3): the Parquet gauges had none.
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&src, &mut files);
        let described: Vec<&str> = files
            .iter()
            .flat_map(|(_, t)| [names_after(t, "describe_counter!("), names_after(t, "describe_gauge!(")].concat())
            .collect();
        let mut used = Vec::new();
        for (path, text) in &files {
            for marker in ["counter!(", "gauge!("] {
                for name in names_after(text, marker) {
                    used.push((name, path.clone()));
                }
            }
        }
        assert!(used.len() > 10, "{used:?}");
        let missing: Vec<_> = used.iter().filter(|(n, _)| !described.contains(n)).collect();
        assert!(missing.is_empty(), "metrics without a describe_*! help text: {missing:?}");
    }
}
