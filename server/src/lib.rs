//! shardstream: a per-node daemon that serves training data to the trainers on its node.
//!
//! Data flows one way, and the modules are named after the step they own:
//!
//! ```text
//!  storage ──► format ──► index ──► plan ──► transport ──► service ──► client
//!  (where shard  (what a    (dataset   (who gets  (how bytes    (gRPC: open,
//!   bytes live)   shard      manifest,  which      reach the     stream,
//!                 looks      shard      sample,    trainer)      status)
//!                 like)      tables)    when)
//! ```
//!
//! - [`storage`]: dataset URLs, listing shards, reading byte ranges (local / parallel file system,
//!   S3 with retries).
//! - [`cache`]: the node cache of shard copies (single flight, verified, Belady or LRU eviction).
//! - [`prefetch`]: merges every active consumer's future order and fetches shards ahead of need.
//! - [`format`]: shard formats ([`format::Format`]: WebDataset TAR and Parquet): find, name and
//!   index a shard, locate a sample's fields, decode and gather Parquet row groups.
//! - [`index`]: the dataset manifest (`manifest.json`) and the in-memory sample index: per-shard
//!   sample counts for the whole dataset, member tables only for the shards in use.
//! - [`plan`]: the deterministic, exactly-once epoch plan (pure functions, no I/O).
//! - [`transport`]: how a batch's bytes travel to the consumer (inline in gRPC messages, shared
//!   memory on the same host, rdma).
//! - [`service`]: the gRPC service and the per-consumer stream producer.
//! - [`daemon`]: binding a listener and serving until shutdown (used by `serve` and by the Python
//!   package's embedded server alike).
//! - [`pack`]: `shardstream pack`, turning a tree of small files into shards with a manifest.
//! - [`cli`]: the `shardstream` command line.
//! - `failpoints` (feature `failpoints` only): fault injection for the failpoint and chaos tests.
//! - [`socket_file`]: the daemon's Unix socket files: mode, group, stale-socket replacement.
//! - [`access`]: the config file's `allow` list: which peer (uid/gid, or remote client name) may open
//!   which datasets; [`remote`]: TLS, bearer tokens and `--insecure` for TCP listeners;
//!   [`accept`]: a listener's connections (TCP or Unix), each given a deadline for its handshake;
//!   [`cert_name`]: the subject CN a mutual-TLS client is known by.
//! - [`cli`]: the `shardstream` command line; [`config`]: `serve --config` (TOML) merged with flags
//!   and environment; [`logging`]: `--log` / `--log-format`; [`panics`]: the panic hook that
//!   logs through them, and `catch` for dependencies that panic on damaged input; [`notify`]:
//!   sd_notify; [`malloc`]: the allocator thresholds `serve` sets.
//!
//! Lock order, where more than one is held: dataset registry -> shard table cache; prefetch
//! consumers -> node cache table. No lock is held across an `.await` or a disk read.

/// A failpoint: `fail::fail_point!` in a build with the `failpoints` feature, nothing at all
/// without it (the `fail` crate is then not even a dependency). Defined before the modules so that
/// every module sees it. The points and what they inject: the `failpoints` module.
#[cfg(feature = "failpoints")]
macro_rules! fail_point {
    ($($t:tt)*) => { fail::fail_point!($($t)*) };
}
#[cfg(not(feature = "failpoints"))]
macro_rules! fail_point {
    ($($t:tt)*) => {};
}

pub mod accept;
pub mod access;
pub mod atomic_write;
pub mod cache;
pub mod cache_hint;
pub mod cert_name;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod error;
#[cfg(feature = "failpoints")]
pub mod failpoints;
pub mod format;
pub mod index;
pub mod limits;
pub mod logging;
pub mod malloc;
pub mod metrics;
pub mod nofile;
pub mod notify;
pub mod pack;
pub mod panics;
pub mod parallel;
pub mod plan;
pub mod prefetch;
pub mod remote;
pub mod service;
pub mod shutdown;
pub mod socket_file;
pub mod stable_hash;
pub mod storage;
pub mod transport;

pub use error::{Error, Result};

/// This build's version, reported by `status` and written into manifests.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
