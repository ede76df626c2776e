//! The `shardstream` command line: `serve`, `index`, `pack`, `prefetch`, `status`. Shared by the standalone binary and
//! the Python package (whose `shardstream` console script calls [`main_with_args`]), so one install
//! serves both the trainer and the operator.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
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
#[expect(clippy::large_enum_variant, reason = "parsed once per process, from the command line")]
pub enum Command {
    /// Run the node daemon: serve datasets to trainer processes until SIGTERM/Ctrl-C.
    Serve(ServeArgs),
    /// Write manifest.json and per-shard index sidecars for shards made elsewhere (for Parquet,
    /// also every footer in one object).
    Index {
        /// Dataset: a directory, file:// URL or s3://bucket/prefix/ (not a pattern: the manifest
        /// describes every shard of the directory).
        url: String,
        /// Threads reading shards in parallel [default: one per core, at most 16, for TAR shards,
        /// which are read whole; 32 for Parquet files, whose footer reads wait on the round trip].
        #[arg(long, value_parser = limits::parse_threads)]
        threads: Option<usize>,
    },
    /// Turn a tree of small files into shards (WebDataset TAR or Parquet) with a manifest.
    Pack(crate::pack::PackArgs),
    /// Stage a dataset into a running daemon's node cache, in the order an epoch will use it.
    Prefetch {
        /// Dataset: s3://bucket/prefix/ (or a path, with --cache copy); a brace pattern or a glob in
        /// the file name picks some shards (quote a glob, or the shell expands it).
        url: String,
        /// Daemon address (default: $SHARDSTREAM_ADDR, else the default socket).
        #[arg(long, env = "SHARDSTREAM_ADDR", default_value = "unix:///run/shardstream/sock")]
        connect: String,
        /// Stage only the first N shards of the epoch's order (default: all that fit); the first
        /// N row groups where a Parquet dataset goes through a node cache smaller than it a row
        /// group at a time (the progress says which it counts).
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
        #[arg(long, default_value = "auto", value_parser = ["auto", "copy"])]
        cache: String,
        /// Parquet: stage what trainers selecting these columns read (comma-separated, as their
        /// `fields=`): on S3, each file's copy of those columns' chunks instead of the whole file.
        /// The variable pairs with SHARDSTREAM_DATASET, which the Slurm TaskProlog stages.
        #[arg(long, env = "SHARDSTREAM_DATASET_FIELDS", value_delimiter = ',')]
        fields: Vec<String>,
        /// Seconds the daemon may leave a ping unanswered (stopped, frozen) before prefetch gives
        /// up; a daemon busy opening a large dataset still answers pings.
        #[arg(long, default_value_t = 20.0, value_parser = parse_seconds)]
        timeout: f64,
    },
    /// Show what a running daemon is doing. Exits 0 only when the daemon answers, so it doubles
    /// as a readiness/liveness probe (Kubernetes exec probe, scripts).
    Status {
        /// Daemon address (default: $SHARDSTREAM_ADDR, else the default socket).
        #[arg(long, env = "SHARDSTREAM_ADDR", default_value = "unix:///run/shardstream/sock")]
        connect: String,
        /// Seconds to wait for the daemon's answer before giving up (exit 1).
        #[arg(long, default_value_t = 10.0)]
        timeout: f64,
        /// Keep trying for up to this many seconds until the daemon answers (a trainer's init
        /// step waiting for its node daemon); default: one attempt.
        #[arg(long, default_value_t = 0.0)]
        wait: f64,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// `shardstream serve`. Every option (but `--config`, `--print-config`) is also a key of the config
/// file, spelled as the long flag without dashes (`cache-size = "500GiB"`). Precedence: command
/// line > `SHARDSTREAM_*` environment > config file > built-in default (see [`crate::config`]).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// TOML config file: any option below as a key, plus the `allow` list (see deploy/README.md).
    #[arg(long, env = "SHARDSTREAM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the effective configuration (after flags, environment and file) as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
    /// Where to listen: unix:///path/to/socket or tcp://host:port. A socket path is at most 103
    /// bytes (it and its side channel `<path>.shm` must fit in a Unix socket address).
    #[arg(long, env = "SHARDSTREAM_LISTEN", default_value = "unix:///run/shardstream/sock")]
    pub listen: String,
    /// Permission bits of the Unix sockets (octal; 0660 lets the socket's group connect).
    #[arg(long, env = "SHARDSTREAM_SOCKET_MODE", default_value = "0600", value_parser = crate::socket_file::parse_mode)]
    pub socket_mode: u32,
    /// Group owning the Unix sockets (name or numeric gid); the daemon must be a member.
    #[arg(long, env = "SHARDSTREAM_SOCKET_GROUP", value_parser = crate::socket_file::parse_group)]
    pub socket_group: Option<u32>,
    /// Node cache directory: shard copies (S3, cache=copy) and index sidecars.
    #[arg(long, env = "SHARDSTREAM_CACHE_DIR", default_value = "/var/cache/shardstream")]
    pub cache_dir: PathBuf,
    /// Node cache capacity (e.g. 500GiB, 2TB); default: 90% of the cache file system's space.
    #[arg(long, env = "SHARDSTREAM_CACHE_SIZE", value_parser = limits::parse_cache_size)]
    pub cache_size: Option<u64>,
    /// Eviction policy: belady (farthest next use, from the known future order) or lru.
    #[arg(long, env = "SHARDSTREAM_CACHE_POLICY", default_value = "belady")]
    pub cache_policy: crate::cache::table::Policy,
    /// Do not keep decoded Parquet row groups in the node cache (binary_views streams keep every
    /// row group they decode; others those decoded again past --decoded-budget): they then live
    /// in memory only, and every daemon, and past the budget every epoch, decodes them again.
    #[arg(long, env = "SHARDSTREAM_NO_KEEP_DECODED", value_parser = clap::builder::BoolishValueParser::new())]
    pub no_keep_decoded: bool,
    /// Memory for decoded Parquet row groups, shared by all streams (e.g. 4GiB). A shuffled
    /// epoch decodes each row group about once while the dataset's selected columns, decoded,
    /// fit; past that, row groups are decoded again every epoch, and only what the streams'
    /// windows need is held (4 windows a stream, at least a quarter of the budget).
    #[arg(long, env = "SHARDSTREAM_DECODED_BUDGET", default_value = "1GiB", value_parser = limits::parse_decoded_budget)]
    pub decoded_budget: u64,
    /// How far ahead of each consumer to fetch shards, in seconds of its consumption.
    #[arg(long, env = "SHARDSTREAM_PREFETCH_HORIZON", default_value_t = 60.0, value_parser = limits::parse_prefetch_horizon)]
    pub prefetch_horizon: f64,
    /// Shards fetched ahead at once.
    #[arg(long, env = "SHARDSTREAM_PREFETCH_PARALLEL", default_value_t = crate::prefetch::PrefetchConfig::default().parallel, value_parser = limits::parse_prefetch_parallel)]
    pub prefetch_parallel: usize,
    /// S3: bytes per ranged GET.
    #[arg(long, env = "SHARDSTREAM_S3_PART_SIZE", default_value = "32MiB", value_parser = limits::parse_s3_get_part_size)]
    pub s3_part_size: u64,
    /// S3: ranged GETs in flight per shard.
    #[arg(long, env = "SHARDSTREAM_S3_CONCURRENCY", default_value_t = crate::storage::s3::DEFAULT_CONCURRENCY, value_parser = limits::parse_s3_concurrency)]
    pub s3_concurrency: usize,
    /// S3: retries of a failed request before giving up (0 disables retries).
    #[arg(long, env = "SHARDSTREAM_S3_MAX_RETRIES", default_value_t = crate::storage::retry::RetryConfig::default().max_retries, value_parser = limits::parse_s3_max_retries)]
    pub s3_max_retries: u32,
    /// Serve transport="rdma" streams (remote trainers; libfabric loaded at run time). The
    /// daemon refuses to start if libfabric or the provider cannot be opened.
    #[arg(long, env = "SHARDSTREAM_RDMA", value_parser = clap::builder::BoolishValueParser::new())]
    pub rdma: bool,
    /// With --rdma: the libfabric provider (e.g. "verbs;ofi_rxm", "efa", "tcp"), the only one it
    /// serves; default SHARDSTREAM_FI_PROVIDER / FI_PROVIDER, else libfabric's first.
    #[arg(long, env = "SHARDSTREAM_RDMA_PROVIDER")]
    pub rdma_provider: Option<String>,
    /// With --rdma: staging memory all rdma streams together may hold (e.g. 4GiB; default a
    /// quarter of physical memory or of the cgroup memory limit, whichever is smaller). Each
    /// stream stages 4 of the client's ring slots (SHARDSTREAM_RDMA_SLOT_BYTES, 32 MiB by
    /// default) in memory registered with the NIC, which verbs and EFA pin. A stream that does not
    /// fit waits up to 10 s, then fails with RESOURCE_EXHAUSTED ("rdma staging budget exhausted").
    #[arg(long, env = "SHARDSTREAM_RDMA_BUDGET", value_parser = limits::parse_rdma_budget)]
    pub rdma_budget: Option<u64>,
    /// Shared memory, view mode: unreleased batches one stream's client may hold before the
    /// daemon waits (each costs the daemon only its lease records).
    #[arg(long, env = "SHARDSTREAM_SHM_CREDITS", default_value_t = crate::transport::shm::DEFAULT_CREDITS, value_parser = limits::parse_shm_credits)]
    pub shm_credits: u32,
    /// Shared memory, packed mode (collate="stack"): slots of each stream's ring, i.e. the
    /// batches a client may hold; the ring's memory is this many batches.
    #[arg(long, env = "SHARDSTREAM_RING_SLOTS", default_value_t = crate::transport::ring::RING_SLOTS, value_parser = limits::parse_ring_slots)]
    pub ring_slots: u32,
    /// Shared memory, packed mode: ring memory all streams together may hold (e.g. 8GiB; default
    /// a quarter of physical memory or of the cgroup memory limit, whichever is smaller). A stream
    /// whose ring does not fit waits up to 10 s, then fails with RESOURCE_EXHAUSTED ("packed ring
    /// budget exhausted").
    #[arg(long, env = "SHARDSTREAM_PACKED_BUDGET", value_parser = crate::pack::cli::parse_size)]
    pub packed_budget: Option<u64>,
    /// Inline batches (TCP, transport="inline"): their bytes all streams together may keep
    /// queued for clients that have not read them yet (e.g. 2GiB; default a quarter of physical
    /// memory or of the cgroup memory limit, whichever is smaller). Past it a stream with more
    /// than 1 MiB still queued builds no more until its client reads them; one under that goes
    /// on, so the bound is this plus about 1 MiB and a batch per stream.
    #[arg(long, env = "SHARDSTREAM_INLINE_BUDGET", value_parser = limits::parse_inline_budget)]
    pub inline_budget: Option<u64>,
    /// Shared memory, packed mode and Arrow batches: seconds a stream's ring is kept after the
    /// stream ends, for the next stream of a client with the same uid and gid (its next epoch
    /// then skips making one); 0 keeps none. Kept rings count against --packed-budget and give
    /// way to any stream that needs the room.
    #[arg(long, env = "SHARDSTREAM_RING_KEEP", default_value_t = crate::transport::ring_pool::DEFAULT_KEEP_FOR.as_secs_f64(), value_parser = parse_seconds)]
    pub ring_keep: f64,
    /// Streams the daemon serves at once, over all clients; one more is refused with
    /// RESOURCE_EXHAUSTED naming this flag. A stream waiting on its client (a DataLoader worker
    /// whose queue is full) holds a thread of the daemon's blocking pool, which is sized to this
    /// and as much again for opening datasets and fetching, so streams cannot starve those.
    #[arg(long, env = "SHARDSTREAM_MAX_STREAMS", default_value_t = crate::service::DEFAULT_MAX_STREAMS, value_parser = limits::parse_max_streams)]
    pub max_streams: usize,
    /// Streams the daemon serves one client at once (unset: as many as --max-streams); one more
    /// is refused with RESOURCE_EXHAUSTED naming this flag, and other clients are served. A
    /// client is a uid on the Unix socket; over TCP the name its token or client certificate
    /// gives it, else its IP address. Set it where several jobs or teams share a daemon, so that
    /// one cannot hold every stream.
    #[arg(long, env = "SHARDSTREAM_MAX_STREAMS_PER_CLIENT", value_parser = limits::parse_max_streams_per_client)]
    pub max_streams_per_client: Option<usize>,
    /// Serve Prometheus metrics on HOST:PORT (GET /metrics).
    #[arg(long, env = "SHARDSTREAM_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// After SIGTERM: seconds in-flight streams get to end (their clients see ConnectionError)
    /// before the daemon exits anyway.
    #[arg(long, env = "SHARDSTREAM_DRAIN_TIMEOUT", default_value_t = crate::daemon::DEFAULT_DRAIN_TIMEOUT.as_secs_f64(), value_parser = parse_seconds)]
    pub drain_timeout: f64,
    /// TLS certificate chain (PEM) of a TCP listener. A TCP listener needs TLS plus
    /// --tokens and/or --tls-client-ca, or --insecure on a loopback address.
    #[arg(long, env = "SHARDSTREAM_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "SHARDSTREAM_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// CA (PEM) that signs client certificates: with it, TCP clients must present one (mutual TLS).
    #[arg(long, env = "SHARDSTREAM_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// Bearer tokens of TCP clients: one NAME:TOKEN per line; the allow list's `client` key
    /// matches NAME. Tokens are never logged.
    #[arg(long = "tokens", env = "SHARDSTREAM_TOKENS")]
    pub token_file: Option<PathBuf>,
    /// Allow plaintext TCP (no TLS). Refused unless the listen address is loopback.
    #[arg(long, env = "SHARDSTREAM_INSECURE", value_parser = clap::builder::BoolishValueParser::new())]
    pub insecure: bool,
    /// Seconds a TCP client may stay silent before an HTTP/2 ping, and then its answer, are
    /// waited for: a client cut off (no reset ever comes) has its stream ended within twice this.
    /// Also the time a new connection (TCP or the Unix socket) has to finish its TLS handshake
    /// and start HTTP/2.
    #[arg(long, env = "SHARDSTREAM_TCP_TIMEOUT", default_value_t = shardstream_client::TCP_TIMEOUT.as_secs(), value_parser = limits::parse_tcp_timeout)]
    pub tcp_timeout: u64,
    /// Log level of shardstream's own messages (error, warn, info, debug, trace; dependencies
    /// stay at info or quieter), or a full tracing directive such as `info,h2=debug`.
    #[arg(long, env = "SHARDSTREAM_LOG", default_value = "info", value_parser = crate::logging::parse_log)]
    pub log: String,
    /// Log format: text (for people) or json (one object per line, for log shippers).
    #[arg(long, env = "SHARDSTREAM_LOG_FORMAT", default_value = "text")]
    pub log_format: crate::logging::LogFormat,
}

/// A duration flag in seconds: a finite number from 0 to one day (so a config file's value is
/// checked by the same parser, and its error names the key).
fn parse_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(v.is_finite() && (0.0..=86_400.0).contains(&v)) {
        return Err(format!("{s:?}: must be from 0 to 86400 seconds"));
    }
    Ok(v)
}

/// Runs the CLI with the given arguments (argv[0] included) and returns the exit code.
/// stdout went away (`shardstream status | head -1`): the command's output ends there, quietly,
/// as a shell tool's does; `println!` would panic.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed")]
pub(crate) struct StdoutClosed;

/// `println!` for a command's output: `?` ends the command on an error writing it, and a reader
/// that went away ends it as a success ([`StdoutClosed`]).
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*).map_err(|e| -> anyhow::Error {
            if e.kind() == std::io::ErrorKind::BrokenPipe { $crate::cli::StdoutClosed.into() } else { e.into() }
        })
    }};
}
pub(crate) use outln;

pub fn main_with_args<I, T>(args: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    // Every command: a panic arrow-rs raises on a damaged file and the decoder catches is its
    // error alone (`index` reads footers too); `serve` and `pack` also log other panics.
    crate::panics::install_hook();
    let cli = match crate::config::parse(args) {
        Ok(c) => c,
        Err(crate::config::ParseError::Clap(e)) => {
            let _ = e.print();
            return if e.use_stderr() { 2 } else { 0 };
        }
        Err(e) => {
            eprintln!("shardstream: error: {e}");
            return 2;
        }
    };
    let (cli, allow) = cli;
    if let Command::Serve(args) = &cli.command
        && args.print_config
    {
        use std::io::Write as _;
        return match write!(std::io::stdout().lock(), "{}", crate::config::effective_toml(args, &allow)) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                eprintln!("shardstream: error: cannot write the configuration: {e}");
                1
            }
            _ => 0,
        };
    }
    match run(cli, allow) {
        Ok(()) => 0,
        Err(e) if e.downcast_ref::<StdoutClosed>().is_some() => 0,
        Err(e) => {
            // The chain, each cause once: most errors here already name their cause in their message.
            eprintln!("shardstream: error: {}", shardstream_client::error_chain(e.as_ref()));
            1
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

/// Runs a parsed command line; `allow`: the config file's `allow` list (`serve` only).
pub fn run(cli: Cli, allow: Vec<crate::access::AllowRule>) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => serve(args, allow),
        Command::Index { url, threads } => index(&expand_home(url)?, threads),
        Command::Pack(args) => {
            // Warnings only (e.g. the no-openat2 fallback): progress and bad inputs have their own display.
            crate::logging::init(
                &std::env::var("SHARDSTREAM_LOG").unwrap_or_else(|_| "warn".into()),
                crate::logging::LogFormat::Text,
            );
            crate::pack::run_cli(args)
        }
        Command::Prefetch { url, connect, shards, seed, epoch, no_shuffle, cache, fields, timeout } => {
            // An empty SHARDSTREAM_DATASET_FIELDS (or `--fields ''`) is no selection.
            let fields = if fields == [""] { Vec::new() } else { fields };
            if fields.iter().any(String::is_empty) {
                anyhow::bail!("--fields: an empty column name (give names separated by commas)");
            }
            let req = shardstream_proto::PrefetchRequest {
                url: client_url(url)?,
                protocol_version: shardstream_proto::PROTOCOL_VERSION,
                max_shards: shards.unwrap_or(0),
                seed,
                epoch,
                shuffle: !no_shuffle,
                shuffle_window: 0,
                cache,
                fields,
            };
            prefetch(&connect, req, Duration::from_secs_f64(timeout.max(0.001)))
        }
        Command::Status { connect, json, timeout, wait } => status(&connect, json, timeout, wait),
    }
}

fn serve(args: ServeArgs, allow: Vec<crate::access::AllowRule>) -> anyhow::Result<()> {
    crate::logging::init(&args.log, args.log_format);
    // Before the runtime's threads exist: they allocate from the heaps these settings govern.
    let env: Vec<(String, String)> = std::env::vars().collect();
    match crate::malloc::tune_for_serving(&env) {
        crate::malloc::Tuning::Applied => tracing::debug!("malloc thresholds set for serving"),
        crate::malloc::Tuning::LeftToEnvironment => tracing::info!("malloc settings taken from the environment"),
        crate::malloc::Tuning::Unavailable => tracing::debug!("malloc thresholds not set (not glibc)"),
    }
    match crate::nofile::raise_to_hard_limit() {
        Ok(o) if o.low() => tracing::warn!(
            soft = ?o.now,
            "the open-file limit is low for a daemon (a few dozen streams can exhaust it); raise the hard \
             limit (ulimit -Hn, LimitNOFILE=, or the container's nofile)"
        ),
        Ok(o) if o.before != o.now => tracing::info!(from = ?o.before, to = ?o.now, "open-file limit raised"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit to its hard limit"),
    }
    if let (Some(provider), false) = (&args.rdma_provider, args.rdma) {
        // Else rdma would silently not be served: the operator meant it.
        anyhow::bail!(
            "--rdma-provider {provider:?} (SHARDSTREAM_RDMA_PROVIDER) names the provider rdma streams use, but rdma is \
             not served without --rdma (SHARDSTREAM_RDMA=1): add it, or drop the provider"
        );
    }
    let listen: Address = args.listen.parse()?;
    let mut config = DaemonConfig::new(listen, args.cache_dir);
    config.cache_size = args.cache_size;
    config.cache_policy = args.cache_policy;
    config.keep_decoded = !args.no_keep_decoded;
    config.decoded_budget = args.decoded_budget;
    config.prefetch.horizon = Duration::from_secs_f64(args.prefetch_horizon);
    config.prefetch.parallel = args.prefetch_parallel;
    config.s3.part_size = args.s3_part_size;
    config.s3.concurrency = args.s3_concurrency;
    config.s3.retry.max_retries = args.s3_max_retries;
    config.metrics_addr = args.metrics_addr;
    config.shm = crate::transport::shm::ShmConfig {
        credits: args.shm_credits,
        ring_slots: args.ring_slots,
        packed_budget: args.packed_budget.unwrap_or_else(crate::transport::budget::default_budget),
        ring_keep: Duration::from_secs_f64(args.ring_keep),
        ended_per_client: args.max_streams_per_client.unwrap_or(args.max_streams),
    };
    config.rdma = args.rdma.then(|| args.rdma_provider.clone());
    config.rdma_budget = args.rdma_budget.unwrap_or_else(crate::transport::budget::default_budget);
    config.inline_budget = args.inline_budget.unwrap_or_else(crate::transport::budget::default_budget);
    config.socket_access = crate::socket_file::SocketAccess { mode: args.socket_mode, group: args.socket_group };
    config.drain_timeout = Duration::from_secs_f64(args.drain_timeout);
    config.max_streams = args.max_streams;
    config.max_streams_per_client = args.max_streams_per_client;
    config.sd_notify = true;
    config.remote = crate::remote::RemoteOptions {
        tls_cert: args.tls_cert,
        tls_key: args.tls_key,
        tls_client_ca: args.tls_client_ca,
        token_file: args.token_file,
        insecure: args.insecure,
        tcp_timeout: Duration::from_secs(args.tcp_timeout),
    };
    if !allow.is_empty() {
        config.allow = Some(std::sync::Arc::new(crate::access::AllowList::new(&allow)?));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(crate::service::blocking_threads(args.max_streams))
        .build()?;
    let served = rt.block_on(async move {
        let shutdown = CancellationToken::new();
        crate::shutdown::install_signal_handlers(shutdown.clone());
        let daemon = BoundDaemon::bind(config).await?;
        daemon.run(shutdown).await?;
        tracing::info!("stopped");
        Ok(())
    });
    // The drain (--drain-timeout) is over: work still on the blocking pool (a build waiting in
    // storage, an rdma endpoint waiting for a client's credits) must not hold the exit, which
    // dropping the runtime would, for as long as that work takes.
    rt.shutdown_timeout(EXIT_WAIT);
    served
}

/// How long `serve` waits, after its drain, for blocking work to notice the shutdown.
const EXIT_WAIT: Duration = Duration::from_secs(1);

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

fn count_bar(total: u64, what: &'static str) -> indicatif::ProgressBar {
    indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template(&format!("{{bar:40}} {{pos}}/{{len}} shards {what} eta {{eta}}"))
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    )
}

fn index(url: &str, threads: Option<usize>) -> anyhow::Result<()> {
    let rt = runtime()?;
    let s3 = match crate::storage::DatasetUrl::parse(url)? {
        crate::storage::DatasetUrl::S3 { .. } => {
            Some(rt.block_on(crate::storage::s3::S3Store::connect(crate::storage::s3::S3Options::default()))?)
        }
        crate::storage::DatasetUrl::Local { .. } => None,
    };
    let total = crate::index::build::list(url, s3.as_ref())?.iter().map(|&(_, len)| len).fold(0, u64::saturating_add);
    let bar = bytes_bar(total);
    let started = std::time::Instant::now();
    let summary = crate::index::build::index_dataset(url, threads, s3.as_ref(), &Bar(bar.clone()))?;
    bar.finish_and_clear();
    let m = &summary.manifest;
    let secs = started.elapsed().as_secs_f64();
    let keys = match summary.partition_keys.as_slice() {
        [] => String::new(),
        keys => format!("; partition keys: {}", keys.join(", ")),
    };
    outln!(
        "indexed {}, {}, {:.1} MB in {secs:.1} s ({:.0} MB/s); fields: {}{keys}; wrote {}",
        crate::pack::count(m.shards.len() as u64, "shard"),
        crate::pack::count(m.total_samples, "sample"),
        m.total_bytes as f64 / 1e6,
        m.total_bytes as f64 / 1e6 / secs.max(1e-9),
        m.fields.join(", "),
        summary.location
    )?;
    let empty: Vec<&str> = m.shards.iter().filter(|s| s.samples == 0).map(|s| s.name.as_str()).collect();
    if !empty.is_empty() {
        // The daemon leaves them out with a warning in its log; the one who indexed reads it here.
        let shown = empty.iter().take(5).copied().collect::<Vec<_>>().join(", ");
        let more = if empty.len() > 5 { format!(" and {} more", empty.len() - 5) } else { String::new() };
        outln!(
            "{} without samples, which contribute none: {shown}{more}",
            crate::pack::count(empty.len() as u64, "shard")
        )?;
    }
    if let Some((name, samples, split)) = summary.split_keys.first() {
        // The daemon's log says it at each open that scans them; the one who indexed reads it here.
        let others = match summary.split_keys.len() - 1 {
            0 => String::new(),
            n => format!(" ({} more like it)", crate::pack::count(n as u64, "shard")),
        };
        outln!("warning: shard {name}{others}: {}", crate::format::split_keys_message(split, *samples))?;
    }
    if let Some(r) = summary.footer_reads {
        // Parquet is indexed from footers alone: say what that cost, per file.
        outln!(
            "read footers only: {} reads, {} bytes ({:.1} KiB per file)",
            r.reads,
            r.bytes,
            r.bytes as f64 / 1024.0 / m.shards.len().max(1) as f64
        )?;
    }
    if let Some(footers) = &m.footers {
        outln!(
            "footers of all {} files in {footers}: a daemon opens the dataset from it and the manifest",
            m.shards.len()
        )?;
    }
    if s3.is_some() {
        use std::sync::atomic::Ordering::Relaxed;
        outln!(
            "s3: {} requests, {} bytes downloaded",
            crate::metrics::STORAGE_REQUESTS.load(Relaxed),
            crate::metrics::STORAGE_BYTES.load(Relaxed)
        )?;
    }
    Ok(())
}

/// `~` and `~/...` as the shell and the Python client (`os.path.expanduser`) read them: the home
/// directory (`$HOME`, else the user's entry in the password database). A quoted `~` reaches the
/// command unexpanded (a Kubernetes exec-form command, a job's `SHARDSTREAM_DATASET` in the
/// Slurm task prolog), and read literally it named a directory `~` in the working directory
/// while the trainers read the home directory's.
fn expand_home(url: String) -> anyhow::Result<String> {
    home_expanded(url, std::env::home_dir)
}

fn home_expanded(url: String, home_dir: impl FnOnce() -> Option<std::path::PathBuf>) -> anyhow::Result<String> {
    let Some(rest) = url.strip_prefix('~') else { return Ok(url) };
    if !(rest.is_empty() || rest.starts_with('/')) {
        // The Loader reads `~name/...` as name's home directory: read literally here, staging
        // would stage another path than the trainers read.
        anyhow::bail!("{url:?}: another user's home directory (~name) is not expanded here; give its path");
    }
    let home = home_dir()
        .filter(|h| !h.as_os_str().is_empty())
        .ok_or_else(|| anyhow::anyhow!("cannot expand {url:?}: no home directory (HOME is not set)"))?;
    let expanded = format!("{}{rest}", home.display().to_string().trim_end_matches('/'));
    Ok(if expanded.is_empty() { "/".into() } else { expanded })
}

/// A local dataset path made absolute from this process's working directory: the daemon has its
/// own, and refuses relative paths.
fn client_url(url: String) -> anyhow::Result<String> {
    let url = expand_home(url)?;
    if !crate::storage::is_relative_path(&url) {
        return Ok(url);
    }
    let path = std::path::absolute(&url).with_context(|| format!("cannot make {url:?} an absolute path"))?;
    let mut absolute = path.display().to_string();
    if url.ends_with('/') && !absolute.ends_with('/') {
        absolute.push('/');
    }
    Ok(absolute)
}

/// Whether `s` failed because a ping went unanswered (h2's "keep-alive timed out"; the kernel's
/// "operation timed out"), not because the connection was cut or refused. By text: hyper keeps
/// its keep-alive timeout error private, and `hyper::Error::is_timeout` is false for it.
fn unanswered(s: &tonic::Status) -> bool {
    std::error::Error::source(s).is_some_and(|e| shardstream_client::error_chain(e).contains("timed out"))
}

fn prefetch(connect: &str, req: shardstream_proto::PrefetchRequest, silence: Duration) -> anyhow::Result<()> {
    let addr: Address = connect.parse()?;
    let what = match req.fields.as_slice() {
        [] => req.url.clone(),
        fields => format!("{} (columns {})", req.url, fields.join(", ")),
    };
    let started = std::time::Instant::now();
    let last = runtime()?.block_on(async {
        let mut client =
            tokio::time::timeout(Duration::from_secs(10), shardstream_client::connect_watched(&addr, silence))
                .await
                .map_err(|_| anyhow::anyhow!("timed out connecting to {addr}"))??;
        // A daemon that stops answering pings (stopped, frozen) ends the wait: an open without
        // a manifest may take long, so no reply timeout could tell the two apart.
        let refused = |s: tonic::Status| {
            if s.message().starts_with(crate::service::SHUTTING_DOWN) {
                anyhow::anyhow!(
                    "the daemon at {addr} is shutting down: staging stopped there (what it staged stays in the \
                     cache); run prefetch again once a daemon serves"
                )
            } else if !shardstream_client::is_transport_failure(&s) {
                // The daemon's own answer (a store's failure, say), not the connection's.
                anyhow::anyhow!("{}", s.message())
            } else if (s.code() == tonic::Code::Unavailable || s.code() == tonic::Code::Unknown) && unanswered(&s) {
                anyhow::anyhow!(
                    "the daemon at {addr} stopped answering (no reply to a ping within {} s; stopped, frozen or \
                     shutting down?): {}",
                    silence.as_secs_f64(),
                    s.message()
                )
            } else if s.code() == tonic::Code::Unavailable || s.code() == tonic::Code::Unknown {
                // Cut, not silent: the daemon exited (killed, out of memory) or its host went.
                anyhow::anyhow!(
                    "the connection to the daemon at {addr} was lost (did it exit or get killed? its log, or \
                     `shardstream status`, says whether it runs): {}",
                    s.message()
                )
            } else {
                anyhow::anyhow!("{}", s.message())
            }
        };
        let url = req.url.clone();
        // A peer that is no shardstream daemon (a tls:// listener spoken to in plaintext) fails
        // the first request at once: the client's words for it, not "stopped answering". A ping
        // left unanswered (a stopped or frozen daemon) is what `refused` says it is.
        let first = client.clone();
        let first = |s: tonic::Status| match shardstream_client::is_transport_failure(&s) && !unanswered(&s) {
            true => anyhow::Error::new(first.first_answer(s)),
            false => refused(s),
        };
        let mut stream = client.prefetch(req).await.map_err(first)?.into_inner();
        let mut bar: Option<indicatif::ProgressBar> = None;
        let mut indexing: Option<indicatif::ProgressBar> = None;
        let mut last = shardstream_proto::PrefetchProgress::default();
        let mut indexed = 0;
        while let Some(p) = stream.message().await.map_err(refused)? {
            if p.indexing {
                let b = indexing.get_or_insert_with(|| {
                    // Said even without a terminal (a job's log): the wait may be long.
                    eprintln!(
                        "shardstream: the daemon is indexing {url} ({} shards, no manifest.json) before staging; \
                         `shardstream index {url}` writes a manifest once so that opens skip this",
                        p.shards_total
                    );
                    count_bar(p.shards_total, "indexed")
                });
                b.set_position(p.shards_done);
                indexed = p.shards_total;
                continue;
            }
            if let Some(b) = indexing.take() {
                b.finish_and_clear();
            }
            let b = bar.get_or_insert_with(|| bytes_bar(p.bytes_total));
            b.set_position(p.bytes_done);
            b.set_message(format!("{}/{} {} {}", p.shards_done, p.shards_total, unit_of(&p), p.shard));
            last = p;
        }
        for b in [indexing, bar].into_iter().flatten() {
            b.finish_and_clear();
        }
        anyhow::Ok((last, indexed))
    })?;
    let (last, indexed) = last;
    let secs = started.elapsed().as_secs_f64();
    let first = if indexed > 0 { format!("; the open indexed {indexed} shards first") } else { String::new() };
    outln!(
        "staged {} of {} {} of {what} ({:.1} of {:.1} MB, {} already cached{first}) in {secs:.1} s",
        last.shards_done,
        last.shards_total,
        unit_of(&last),
        last.bytes_done as f64 / 1e6,
        last.bytes_total as f64 / 1e6,
        last.already_cached
    )?;
    if last.cache_full {
        eprintln!(
            "shardstream: warning: the node cache is full; the remaining {} {} will be fetched during training",
            last.shards_total - last.shards_done,
            unit_of(&last)
        );
    }
    Ok(())
}

/// What a staging's progress counts: shards, or the row groups of a node cache that keeps a copy
/// per row group.
fn unit_of(p: &shardstream_proto::PrefetchProgress) -> &str {
    if p.unit.is_empty() { "shards" } else { &p.unit }
}

fn status(connect: &str, json: bool, timeout: f64, wait: f64) -> anyhow::Result<()> {
    let addr: Address = connect.parse()?;
    if !(timeout.is_finite() && timeout > 0.0) {
        anyhow::bail!("--timeout must be a positive number of seconds, not {timeout}");
    }
    if !(wait.is_finite() && wait >= 0.0) {
        anyhow::bail!("--wait must be a number of seconds >= 0, not {wait}");
    }
    let limit = Duration::from_secs_f64(timeout.min(3600.0));
    let until = std::time::Instant::now() + Duration::from_secs_f64(wait.min(86400.0));
    let rt = runtime()?;
    let reply = loop {
        match rt.block_on(status_once(&addr, limit, timeout)) {
            Ok(r) => break r,
            Err(e) if std::time::Instant::now() >= until || e.downcast_ref().is_some_and(no_wait_changes) => {
                return Err(e);
            }
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    };
    print_status(&addr, &reply, json)
}

/// A failure to connect that is this side's (a socket that refuses this user, a missing CA, a key
/// not the certificate's, an address that does not parse): the daemon may well be serving, and
/// no wait changes it, so `status --wait` says it at once, as it is.
fn no_wait_changes(e: &shardstream_client::ClientError) -> bool {
    use shardstream_client::ClientError;
    matches!(e, ClientError::Refused { .. } | ClientError::Credentials(_) | ClientError::BadAddress(_))
}

/// One attempt: connect and ask, under one deadline (a daemon that accepts but hangs is not ready).
/// A socket that refuses this user stays a `ClientError::Refused`: the one failure no wait changes.
async fn status_once(addr: &Address, limit: Duration, timeout: f64) -> anyhow::Result<shardstream_proto::StatusReply> {
    tokio::time::timeout(limit, async {
        let mut client = shardstream_client::connect(addr).await.map_err(|e| {
            if no_wait_changes(&e) {
                anyhow::Error::new(e)
            } else {
                anyhow::anyhow!("daemon at {addr} is not serving: {e}")
            }
        })?;
        let reply = client.status(shardstream_proto::StatusRequest {}).await.map_err(|s| {
            // A peer that is no shardstream daemon (a tls:// listener spoken to in plaintext,
            // another service) shows here: the client's own words for it, not a bare "transport error".
            match client.first_answer(s) {
                shardstream_client::ClientError::Status(s) => {
                    anyhow::anyhow!("daemon at {addr} did not answer: {}", s.message())
                }
                e => anyhow::anyhow!("daemon at {addr} did not answer: {e}"),
            }
        })?;
        anyhow::Ok(reply.into_inner())
    })
    .await
    .map_err(|_| anyhow::anyhow!("daemon at {addr} did not answer within {timeout} s"))?
}

fn print_status(addr: &Address, reply: &shardstream_proto::StatusReply, json: bool) -> anyhow::Result<()> {
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
                "capacity_bytes": c.capacity_bytes, "configured_capacity_bytes": c.configured_capacity_bytes,
                "used_bytes": c.used_bytes, "shards": c.shards,
                "hits": c.hits, "misses": c.misses, "evictions": c.evictions,
                "filled_bytes": c.filled_bytes, "high_water_bytes": c.high_water_bytes, "policy": c.policy,
                "decoded_row_groups": c.decoded_row_groups, "decoded_bytes": c.decoded_bytes,
            })),
            "storage_bytes": reply.storage_bytes, "storage_requests": reply.storage_requests,
            "storage_retries": reply.storage_retries, "prefetch_horizon_s": reply.prefetch_horizon_s,
            "prefetches_in_flight": reply.prefetches_in_flight,
            "shm_sessions": reply.shm_sessions, "leased_shards": reply.leased_shards,
            "ring_bytes": reply.ring_bytes, "kept_rings": reply.kept_rings,
            "kept_ring_bytes": reply.kept_ring_bytes, "rings_made": reply.rings_made,
            "rings_reused": reply.rings_reused, "rdma_provider": reply.rdma_provider,
            "rdma_streams": reply.rdma_streams, "rdma_ring_bytes": reply.rdma_ring_bytes,
            "rdma_staging_bytes": reply.rdma_staging_bytes, "rdma_budget_bytes": reply.rdma_budget_bytes,
            "decoded_memory_bytes": reply.decoded_memory_bytes, "decoded_budget_bytes": reply.decoded_budget_bytes,
            "inline_queued_bytes": reply.inline_queued_bytes, "inline_budget_bytes": reply.inline_budget_bytes,
            "consumers": reply.consumers.iter().map(|c| serde_json::json!({
                "url": c.url, "rank": c.rank, "worker": c.worker, "position": c.position,
                "samples_per_s": c.samples_per_s, "wait_s": c.wait_s,
            })).collect::<Vec<_>>(),
        });
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    outln!("shardstream {} at {addr}, up {:.0} s", reply.version, reply.uptime_ms as f64 / 1000.0)?;
    outln!("cache dir       {}", reply.cache_dir)?;
    outln!("streams         {} active, {} total", reply.active_streams, reply.streams_total)?;
    outln!("served          {} samples, {:.1} MB", reply.samples_served, reply.bytes_served as f64 / 1e6)?;
    outln!("read time       {:.1} s", reply.read_wait_ms as f64 / 1000.0)?;
    if let Some(c) = &reply.cache {
        // In the capacity's unit: a cache of a few MB read "0.0 of 0.0 GB".
        let (scale, unit) = if c.capacity_bytes >= 1_000_000_000 { (1e9, "GB") } else { (1e6, "MB") };
        outln!(
            "node cache      {:.1} of {:.1} {unit} in {} shards ({}); {} hits, {} misses, {} evictions",
            c.used_bytes as f64 / scale,
            c.capacity_bytes as f64 / scale,
            c.shards,
            c.policy,
            c.hits,
            c.misses,
            c.evictions
        )?;
        if c.capacity_bytes < c.configured_capacity_bytes {
            outln!(
                "                lowered from {:.1} {unit}: its file system is full (it comes back as that frees)",
                c.configured_capacity_bytes as f64 / scale
            )?;
        }
        if c.decoded_row_groups > 0 {
            outln!(
                "                of which {:.1} {unit} in {} Parquet row groups kept decoded",
                c.decoded_bytes as f64 / scale,
                c.decoded_row_groups
            )?;
        }
    }
    outln!(
        "storage         {:.1} MB in {} requests ({} retried); prefetch horizon {:.1} s, {} in flight",
        reply.storage_bytes as f64 / 1e6,
        reply.storage_requests,
        reply.storage_retries,
        reply.prefetch_horizon_s,
        reply.prefetches_in_flight
    )?;
    outln!(
        "shared memory   {} sessions, {} shards leased; packed rings {:.1} MB in use, {} kept ({:.1} MB), {} made, {} reused",
        reply.shm_sessions,
        reply.leased_shards,
        reply.ring_bytes as f64 / 1e6,
        reply.kept_rings,
        reply.kept_ring_bytes as f64 / 1e6,
        reply.rings_made,
        reply.rings_reused
    )?;
    // Memory held against a budget, said only when some is.
    for (label, used, budget, what) in [
        (
            "decoded",
            reply.decoded_memory_bytes,
            reply.decoded_budget_bytes,
            "Parquet row groups in memory (--decoded-budget)",
        ),
        (
            "inline",
            reply.inline_queued_bytes,
            reply.inline_budget_bytes,
            "batches queued for clients (--inline-budget)",
        ),
    ] {
        if used > 0 {
            outln!("{label:<16}{:.1} of {:.1} MB of {what}", used as f64 / 1e6, budget as f64 / 1e6)?;
        }
    }
    if !reply.rdma_provider.is_empty() {
        outln!(
            "rdma            provider {}; {} streams, {:.1} MB of client rings, {:.1} of {:.1} MB staging",
            reply.rdma_provider,
            reply.rdma_streams,
            reply.rdma_ring_bytes as f64 / 1e6,
            reply.rdma_staging_bytes as f64 / 1e6,
            reply.rdma_budget_bytes as f64 / 1e6
        )?;
    }
    for c in &reply.consumers {
        outln!(
            "consumer        rank {} worker {}: {} samples in, {:.0} samples/s, waited {:.1} s for data ({})",
            c.rank,
            c.worker,
            c.position,
            c.samples_per_s,
            c.wait_s,
            c.url
        )?;
    }
    for d in &reply.datasets {
        outln!(
            "dataset         {}: {} samples in {} shards ({:.1} MB); {} shard tables resident ({} KiB)",
            d.url,
            d.num_samples,
            d.num_shards,
            d.total_bytes as f64 / 1e6,
            d.resident_shard_tables,
            d.resident_index_bytes / 1024
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::home_expanded;

    #[test]
    fn a_home_path_is_expanded_as_the_shell_does_and_nothing_else_is() {
        let home = |h: &str| {
            let h = PathBuf::from(h);
            move || Some(h)
        };
        let expand = |url: &str, h: &str| home_expanded(url.into(), home(h)).unwrap();
        assert_eq!(expand("~/ds", "/home/u"), "/home/u/ds");
        assert_eq!(expand("~/ds", "/home/u/"), "/home/u/ds");
        assert_eq!(expand("~", "/home/u"), "/home/u");
        assert_eq!(expand("~", "/"), "/");
        assert_eq!(expand("~/ds", "/"), "/ds");
        // Every other URL: as given.
        for url in ["ds/~", "/data/~/ds", "s3://b/~/ds", "ds"] {
            assert_eq!(expand(url, "/home/u"), url);
        }
        // Another user's home (or a name starting with `~`, which the Loader reads as one):
        // refused rather than read otherwise than the trainers read it.
        for url in ["~other/ds", "~ds"] {
            let e = home_expanded(url.into(), home("/home/u")).unwrap_err().to_string();
            assert!(e.contains("~name"), "{e}");
        }
        let none = home_expanded("~/ds".into(), || None).unwrap_err().to_string();
        assert!(none.contains("no home directory"), "{none}");
        assert_eq!(home_expanded("ds".into(), || None).unwrap(), "ds");
    }
}
