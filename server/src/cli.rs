//! The `shardstream` command line: `serve`, `index`, `pack`, `prefetch`, `status`. Shared by the standalone binary and
//! the Python package (whose `shardstream` console script calls [`main_with_args`]), so one install
//! serves both the trainer and the operator.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use shardstream_client::Address;
use tokio_util::sync::CancellationToken;

use crate::daemon::{BoundDaemon, DaemonConfig};
/// Ranges of the size and count flags (shared with configuration loaders).
pub use crate::limits;

#[derive(Debug, Parser)]
#[command(name = "shardstream", version, about = "Node-local data loading daemon for ML training")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node daemon: serve datasets to trainer processes until SIGTERM/Ctrl-C.
    Serve {
        /// Where to listen: unix:///path/to/socket or tcp://host:port.
        #[arg(long, env = "SHARDSTREAM_LISTEN", default_value = "unix:///run/shardstream/sock")]
        listen: String,
        /// Node cache directory: shard copies (S3, cache=copy) and index sidecars.
        #[arg(long, env = "SHARDSTREAM_CACHE_DIR", default_value = "/var/cache/shardstream")]
        cache_dir: PathBuf,
        /// Node cache capacity (e.g. 500GiB, 2TB); default: 90% of the cache file system's space.
        #[arg(long, env = "SHARDSTREAM_CACHE_SIZE", value_parser = limits::parse_cache_size)]
        cache_size: Option<u64>,
        /// Eviction policy: belady (farthest next use, from the known future order) or lru.
        #[arg(long, env = "SHARDSTREAM_CACHE_POLICY", default_value = "belady")]
        cache_policy: crate::cache::table::Policy,
        /// How far ahead of each consumer to fetch shards, in seconds of its consumption.
        #[arg(long, default_value_t = 60.0, value_parser = limits::parse_prefetch_horizon)]
        prefetch_horizon: f64,
        /// Shards fetched ahead at once.
        #[arg(long, default_value_t = crate::prefetch::PrefetchConfig::default().parallel, value_parser = limits::parse_prefetch_parallel)]
        prefetch_parallel: usize,
        /// S3: bytes per ranged GET.
        #[arg(long, default_value = "8MiB", value_parser = limits::parse_s3_get_part_size)]
        s3_part_size: u64,
        /// S3: ranged GETs in flight per shard.
        #[arg(long, default_value_t = crate::storage::s3::DEFAULT_CONCURRENCY, value_parser = limits::parse_s3_concurrency)]
        s3_concurrency: usize,
        /// S3: retries of a failed request before giving up (0 disables retries).
        #[arg(long, default_value_t = crate::storage::retry::RetryConfig::default().max_retries, value_parser = limits::parse_s3_max_retries)]
        s3_max_retries: u32,
        /// Shared memory, view mode: unreleased batches one stream's client may hold before the
        /// daemon waits (each costs the daemon only its lease records).
        #[arg(long, default_value_t = crate::transport::shm::DEFAULT_CREDITS, value_parser = limits::parse_shm_credits)]
        shm_credits: u32,
        /// Shared memory, packed mode (collate="stack"): slots of each stream's ring, i.e. the
        /// batches a client may hold; the ring's memory is this many batches.
        #[arg(long, default_value_t = crate::transport::ring::RING_SLOTS, value_parser = limits::parse_ring_slots)]
        ring_slots: u32,
        /// Shared memory, packed mode: ring memory all streams together may hold (e.g. 8GiB;
        /// default a quarter of physical memory). A stream whose ring does not fit waits up to
        /// 10 s, then fails with RESOURCE_EXHAUSTED ("packed ring budget exhausted").
        #[arg(long, value_parser = crate::pack::cli::parse_size)]
        packed_budget: Option<u64>,
        /// Serve Prometheus metrics on HOST:PORT (GET /metrics).
        #[arg(long, env = "SHARDSTREAM_METRICS_ADDR")]
        metrics_addr: Option<std::net::SocketAddr>,
        /// Log filter (error, warn, info, debug, or a tracing directive).
        #[arg(long, env = "SHARDSTREAM_LOG", default_value = "info")]
        log: String,
    },
    /// Write manifest.json and per-shard index sidecars for shards made elsewhere.
    Index {
        /// Dataset: a directory, file:// URL, s3://bucket/prefix/, or brace pattern of shards.
        url: String,
        /// Threads reading shards in parallel.
        #[arg(long, default_value_t = default_threads(), value_parser = limits::parse_threads)]
        threads: usize,
    },
    /// Turn a tree of small files into shards (WebDataset TAR or Parquet) with a manifest.
    Pack(crate::pack::PackArgs),
    /// Stage a dataset into a running daemon's node cache, in the order an epoch will use it.
    Prefetch {
        /// Dataset: s3://bucket/prefix/ (or a path, with --cache copy).
        url: String,
        /// Daemon address (default: $SHARDSTREAM_ADDR, else the default socket).
        #[arg(long, env = "SHARDSTREAM_ADDR", default_value = "unix:///run/shardstream/sock")]
        connect: String,
        /// Stage only the first N shards of the epoch's order (default: all that fit).
        #[arg(long, value_parser = limits::parse_prefetch_shards)]
        shards: Option<u64>,
        /// The order to follow: the trainers' seed and epoch.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, default_value_t = 0)]
        epoch: u64,
        /// Follow the unshuffled order instead.
        #[arg(long)]
        no_shuffle: bool,
        /// How the dataset is read: copy (through the node cache) or auto.
        #[arg(long, default_value = "auto")]
        cache: String,
    },
    /// Show what a running daemon is doing.
    Status {
        /// Daemon address (default: $SHARDSTREAM_ADDR, else the default socket).
        #[arg(long, env = "SHARDSTREAM_ADDR", default_value = "unix:///run/shardstream/sock")]
        connect: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).min(16)
}

/// Runs the CLI with the given arguments (argv[0] included) and returns the exit code.
pub fn main_with_args<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
    };
    match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("shardstream: error: {e:#}");
            1
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve {
            listen,
            cache_dir,
            cache_size,
            cache_policy,
            prefetch_horizon,
            prefetch_parallel,
            s3_part_size,
            s3_concurrency,
            s3_max_retries,
            shm_credits,
            ring_slots,
            packed_budget,
            metrics_addr,
            log,
        } => {
            init_logging(&log);
            let listen: Address = listen.parse()?;
            if !(prefetch_horizon.is_finite() && prefetch_horizon >= 0.0) {
                anyhow::bail!("--prefetch-horizon must be a number of seconds >= 0, not {prefetch_horizon}");
            }
            let mut config = DaemonConfig::new(listen, cache_dir);
            config.cache_size = cache_size;
            config.cache_policy = cache_policy;
            config.prefetch.horizon = Duration::from_secs_f64(prefetch_horizon);
            config.prefetch.parallel = prefetch_parallel.max(1);
            config.s3.part_size = s3_part_size;
            config.s3.concurrency = s3_concurrency.max(1);
            config.s3.retry.max_retries = s3_max_retries;
            config.metrics_addr = metrics_addr;
            config.shm = crate::transport::shm::ShmConfig {
                credits: shm_credits,
                ring_slots,
                packed_budget: packed_budget.unwrap_or_else(crate::transport::budget::default_budget),
            };
            runtime()?.block_on(async move {
                let shutdown = CancellationToken::new();
                crate::shutdown::install_signal_handlers(shutdown.clone());
                let daemon = BoundDaemon::bind(config).await?;
                daemon.run(shutdown).await?;
                tracing::info!("stopped");
                Ok(())
            })
        }
        Command::Index { url, threads } => index(&url, threads),
        Command::Pack(args) => {
            // Warnings only (e.g. the no-openat2 fallback): progress and bad inputs have their own display.
            init_logging(&std::env::var("SHARDSTREAM_LOG").unwrap_or_else(|_| "warn".into()));
            crate::pack::run_cli(args)
        }
        Command::Prefetch { url, connect, shards, seed, epoch, no_shuffle, cache } => {
            let req = shardstream_proto::PrefetchRequest {
                url,
                protocol_version: shardstream_proto::PROTOCOL_VERSION,
                max_shards: shards.unwrap_or(0),
                seed,
                epoch,
                shuffle: !no_shuffle,
                shuffle_window: 0,
                cache,
            };
            prefetch(&connect, req)
        }
        Command::Status { connect, json } => status(&connect, json),
    }
}

fn init_logging(filter: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

struct Bar(indicatif::ProgressBar);

impl crate::index::build::Progress for Bar {
    fn shard_done(&self, name: &str, bytes: u64) {
        self.0.inc(bytes);
        self.0.set_message(name.to_owned());
    }
}

fn bytes_bar(total: u64) -> indicatif::ProgressBar {
    // indicatif draws nothing when stderr is not a terminal.
    indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    )
}

fn index(url: &str, threads: usize) -> anyhow::Result<()> {
    let rt = runtime()?;
    let s3 = match crate::storage::DatasetUrl::parse(url)? {
        crate::storage::DatasetUrl::S3 { .. } => {
            Some(rt.block_on(crate::storage::s3::S3Store::connect(crate::storage::s3::S3Options::default()))?)
        }
        crate::storage::DatasetUrl::Local { .. } => None,
    };
    let total: u64 = crate::index::build::list(url, s3.as_ref())?.iter().map(|(_, len)| len).sum();
    let bar = bytes_bar(total);
    let started = std::time::Instant::now();
    let summary = crate::index::build::index_dataset(url, threads, s3.as_ref(), &Bar(bar.clone()))?;
    bar.finish_and_clear();
    let m = &summary.manifest;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "indexed {} shards, {} samples, {:.1} MB in {secs:.1} s ({:.0} MB/s); fields: {}; wrote {}",
        m.shards.len(),
        m.total_samples,
        m.total_bytes as f64 / 1e6,
        m.total_bytes as f64 / 1e6 / secs.max(1e-9),
        m.fields.join(", "),
        summary.location
    );
    Ok(())
}

fn prefetch(connect: &str, req: shardstream_proto::PrefetchRequest) -> anyhow::Result<()> {
    let addr: Address = connect.parse()?;
    let url = req.url.clone();
    let started = std::time::Instant::now();
    let last = runtime()?.block_on(async {
        let mut client = tokio::time::timeout(Duration::from_secs(10), shardstream_client::connect(&addr))
            .await
            .map_err(|_| anyhow::anyhow!("timed out connecting to {addr}"))??;
        let mut stream = client.prefetch(req).await?.into_inner();
        let mut bar: Option<indicatif::ProgressBar> = None;
        let mut last = shardstream_proto::PrefetchProgress::default();
        while let Some(p) = stream.message().await? {
            let b = bar.get_or_insert_with(|| bytes_bar(p.bytes_total));
            b.set_position(p.bytes_done);
            b.set_message(format!("{}/{} shards {}", p.shards_done, p.shards_total, p.shard));
            last = p;
        }
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        anyhow::Ok(last)
    })?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "staged {} of {} shards of {url} ({:.1} of {:.1} MB, {} already cached) in {secs:.1} s",
        last.shards_done,
        last.shards_total,
        last.bytes_done as f64 / 1e6,
        last.bytes_total as f64 / 1e6,
        last.already_cached
    );
    if last.cache_full {
        eprintln!(
            "shardstream: warning: the node cache is full; the remaining {} shards will be fetched during training",
            last.shards_total - last.shards_done
        );
    }
    Ok(())
}

fn status(connect: &str, json: bool) -> anyhow::Result<()> {
    let addr: Address = connect.parse()?;
    let reply = runtime()?.block_on(async {
        let mut client = tokio::time::timeout(Duration::from_secs(10), shardstream_client::connect(&addr))
            .await
            .map_err(|_| anyhow::anyhow!("timed out connecting to {addr}"))??;
        anyhow::Ok(client.status(shardstream_proto::StatusRequest {}).await?.into_inner())
    })?;
    if json {
        let datasets: Vec<_> = reply
            .datasets
            .iter()
            .map(|d| {
                serde_json::json!({
                    "url": d.url, "num_samples": d.num_samples, "num_shards": d.num_shards,
                    "total_bytes": d.total_bytes, "resident_shard_tables": d.resident_shard_tables,
                    "resident_index_bytes": d.resident_index_bytes,
                })
            })
            .collect();
        let v = serde_json::json!({
            "version": reply.version, "uptime_ms": reply.uptime_ms, "active_streams": reply.active_streams,
            "streams_total": reply.streams_total, "samples_served": reply.samples_served,
            "bytes_served": reply.bytes_served, "read_wait_ms": reply.read_wait_ms,
            "cache_dir": reply.cache_dir, "datasets": datasets,
            "cache": reply.cache.as_ref().map(|c| serde_json::json!({
                "capacity_bytes": c.capacity_bytes, "used_bytes": c.used_bytes, "shards": c.shards,
                "hits": c.hits, "misses": c.misses, "evictions": c.evictions,
                "filled_bytes": c.filled_bytes, "high_water_bytes": c.high_water_bytes, "policy": c.policy,
            })),
            "storage_bytes": reply.storage_bytes, "storage_requests": reply.storage_requests,
            "storage_retries": reply.storage_retries, "prefetch_horizon_s": reply.prefetch_horizon_s,
            "prefetches_in_flight": reply.prefetches_in_flight,
            "consumers": reply.consumers.iter().map(|c| serde_json::json!({
                "url": c.url, "rank": c.rank, "worker": c.worker, "position": c.position,
                "samples_per_s": c.samples_per_s, "wait_s": c.wait_s,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("shardstream {} at {addr}, up {:.0} s", reply.version, reply.uptime_ms as f64 / 1000.0);
    println!("cache dir       {}", reply.cache_dir);
    println!("streams         {} active, {} total", reply.active_streams, reply.streams_total);
    println!("served          {} samples, {:.1} MB", reply.samples_served, reply.bytes_served as f64 / 1e6);
    println!("read time       {:.1} s", reply.read_wait_ms as f64 / 1000.0);
    if let Some(c) = &reply.cache {
        println!(
            "node cache      {:.1} of {:.1} GB in {} shards ({}); {} hits, {} misses, {} evictions",
            c.used_bytes as f64 / 1e9,
            c.capacity_bytes as f64 / 1e9,
            c.shards,
            c.policy,
            c.hits,
            c.misses,
            c.evictions
        );
    }
    println!(
        "storage         {:.1} MB in {} requests ({} retried); prefetch horizon {:.1} s, {} in flight",
        reply.storage_bytes as f64 / 1e6,
        reply.storage_requests,
        reply.storage_retries,
        reply.prefetch_horizon_s,
        reply.prefetches_in_flight
    );
    for c in &reply.consumers {
        println!(
            "consumer        rank {} worker {}: {} samples in, {:.0} samples/s, waited {:.1} s for data ({})",
            c.rank, c.worker, c.position, c.samples_per_s, c.wait_s, c.url
        );
    }
    for d in &reply.datasets {
        println!(
            "dataset         {}: {} samples in {} shards ({:.1} MB); {} shard tables resident ({} KiB)",
            d.url,
            d.num_samples,
            d.num_shards,
            d.total_bytes as f64 / 1e6,
            d.resident_shard_tables,
            d.resident_index_bytes / 1024
        );
    }
    Ok(())
}
