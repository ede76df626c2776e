//! Binding a listener and serving the gRPC service until shutdown. Used by `shardstream serve` and
//! by the Python package's embedded server alike, so both run the same code.
//!
//! The Unix socket is created owner-only (mode 0600) by default, or with `--socket-mode` /
//! `--socket-group`, from the first moment (see [`crate::socket_file`]), inside a directory this
//! process creates when it does not exist. A stale socket left by a crashed daemon is replaced; a
//! live one, or any other file at that path, is an error and is left alone.
//!
//! A TCP listener (`tcp://` or `tls://`) must be secured as [`crate::remote`] says: TLS with
//! tokens or client certificates, or plaintext on loopback with `--insecure`; `bind` refuses
//! anything else. Its connections, and the Unix socket's, are accepted (and TLS handshakes done)
//! by [`crate::accept`]: each with `--tcp-timeout` to start speaking HTTP/2. Requests are bounded per RPC
//! ([`crate::limits::request_limit`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardstream_client::Address;
use shardstream_proto::shardstream_server::ShardstreamServer;
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;

use crate::index::{Registry, sidecar_cache};
use crate::metrics::Metrics;
use crate::service::Service;
use crate::{Error, Result};

/// Default of `--drain-timeout`: how long a shutdown waits for connections to finish before the
/// daemon exits anyway (a client that stopped reading must not keep a draining daemon alive). It
/// fits in Kubernetes' default 30 s grace period and systemd's 90 s stop timeout.
pub const DEFAULT_DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub listen: Address,
    pub cache_dir: PathBuf,
    /// Node cache capacity in bytes; `None`: most of the cache file system's space.
    pub cache_size: Option<u64>,
    pub cache_policy: crate::cache::table::Policy,
    /// Keep decoded Parquet row groups in the node cache (see `format::parquet::kept`).
    pub keep_decoded: bool,
    /// Bytes of decoded Parquet row groups the daemon keeps in memory (see
    /// `format::parquet::decoded`).
    pub decoded_budget: u64,
    pub prefetch: crate::prefetch::PrefetchConfig,
    pub s3: crate::storage::s3::S3Options,
    /// Where to serve Prometheus metrics (`GET /metrics`), if anywhere.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Credits and ring slots of the shared-memory transport.
    pub shm: crate::transport::shm::ShmConfig,
    /// `Some(provider)`: serve transport="rdma" (`--rdma`), with that provider or the client's.
    pub rdma: Option<Option<String>>,
    /// With `rdma`: bytes of staging buffers (registered memory) all rdma streams may hold.
    pub rdma_budget: u64,
    /// Inline batch bytes queued for clients, all streams together (`serve --inline-budget`).
    pub inline_budget: u64,
    /// Mode and group of the Unix sockets (owner-only by default).
    pub socket_access: crate::socket_file::SocketAccess,
    /// After SIGTERM: how long in-flight streams get to end before the daemon exits anyway.
    pub drain_timeout: std::time::Duration,
    /// Tell systemd (`$NOTIFY_SOCKET`) when serving starts and stops. Only `shardstream serve`
    /// sets it: an embedded server is not the unit's main service.
    pub sd_notify: bool,
    /// Datasets each peer may open (the config file's `allow` list); `None`: all.
    pub allow: Option<Arc<crate::access::AllowList>>,
    /// TLS, tokens and `--insecure` for a TCP listener (unused on a Unix socket).
    pub remote: crate::remote::RemoteOptions,
    /// Streams served at once (`--max-streams`).
    pub max_streams: usize,
    /// Streams served to one client at once (`--max-streams-per-client`); `None`: no bound of
    /// its own.
    pub max_streams_per_client: Option<usize>,
}

impl DaemonConfig {
    /// A daemon on `listen` with its cache in `cache_dir` and every other setting at its default.
    pub fn new(listen: Address, cache_dir: PathBuf) -> Self {
        Self {
            listen,
            cache_dir,
            cache_size: None,
            cache_policy: crate::cache::table::Policy::Belady,
            keep_decoded: true,
            decoded_budget: crate::format::parquet::decoded::DEFAULT_BUDGET_BYTES,
            prefetch: crate::prefetch::PrefetchConfig::default(),
            s3: crate::storage::s3::S3Options::default(),
            metrics_addr: None,
            shm: crate::transport::shm::ShmConfig::default(),
            rdma: None,
            rdma_budget: crate::transport::budget::default_budget(),
            inline_budget: crate::transport::budget::default_budget(),
            socket_access: crate::socket_file::SocketAccess::default(),
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            sd_notify: false,
            allow: None,
            remote: crate::remote::RemoteOptions::default(),
            max_streams: crate::service::DEFAULT_MAX_STREAMS,
            max_streams_per_client: None,
        }
    }
}

enum Listener {
    Unix(UnixListener, PathBuf),
    Tcp(TcpListener),
}

/// A daemon whose listener is bound: clients can connect from now on (they queue until `run`).
pub struct BoundDaemon {
    listener: Listener,
    /// The TCP listener's checked security settings (default on a Unix socket).
    security: crate::remote::RemoteSecurity,
    shm: Option<Arc<crate::transport::shm::ShmHub>>,
    rdma: Option<Arc<crate::transport::rdma::RdmaHub>>,
    /// The node cache, opened and locked by `bind`.
    cache: Arc<crate::cache::NodeCache>,
    config: DaemonConfig,
    pub metrics: Arc<Metrics>,
}

/// Creates the node cache directory for the daemon's user alone (clients get descriptors, never
/// paths), and warns when one made elsewhere lets others in: they could read the cached copy of
/// any dataset, whatever the allow list says. Its mode is the operator's to change. Returns the
/// directory's real location, by which the daemon then knows it: under an allow list every open
/// is checked against where its descriptor really leads ([`crate::storage::confine`]), so a cache
/// named relatively or through a link (`/var/cache` linked to a larger disk) would have each of its
/// copies refused.
fn create_private_cache_dir(dir: &std::path::Path) -> Result<std::path::PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if let Ok(meta) = std::fs::metadata(dir)
        && !meta.is_dir()
    {
        return Err(Error::invalid(format!("cache directory {} is a file, not a directory", dir.display())));
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| Error::io("cannot create cache directory", dir, e))?;
    let meta = std::fs::metadata(dir).map_err(|e| Error::io("cannot inspect cache directory", dir, e))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        tracing::warn!(
            "node cache {} has mode {mode:04o}: other users can read the cached copies of every dataset, whatever \
             the allow list says (clients need no access to it); chmod 0700 it",
            dir.display()
        );
    }
    std::fs::canonicalize(dir).map_err(|e| Error::io("cannot resolve cache directory", dir, e))
}

impl BoundDaemon {
    /// Creates and opens the node cache, then binds the listener.
    pub async fn bind(mut config: DaemonConfig) -> Result<Self> {
        // The socket directory first: when the cache lives beside the socket, creating the cache
        // directory must not create the socket's parent with the wrong mode.
        if let Address::Unix(path) = &config.listen {
            // Checked before anything is made: the side channel's path is the longer one.
            crate::socket_file::check_len(
                path,
                crate::socket_file::SUN_PATH_MAX - crate::transport::shm::SIDE_SUFFIX.len(),
                &format!(
                    "its side channel, {}, must fit in a Unix socket address's {}",
                    crate::transport::shm::side_socket_path(path).display(),
                    crate::socket_file::SUN_PATH_MAX
                ),
            )?;
            crate::socket_file::prepare_dir(path, &config.socket_access)?;
        }
        // Before the directory is made: a refused one leaves nothing behind.
        crate::cache::refuse_nested(&config.cache_dir)?;
        config.cache_dir = create_private_cache_dir(&config.cache_dir)?;
        let mut security = crate::remote::RemoteSecurity::default();
        let (listener, shm) = match &config.listen {
            Address::Unix(path) => {
                // Both paths are vetted before either socket is made, and the side channel is
                // bound first: once the main socket accepts, everything a client needs exists.
                // If the main socket fails, dropping the hub removes the side channel again.
                let side = crate::transport::shm::side_socket_path(path);
                crate::socket_file::clear_stale(path, rustix::net::SocketType::STREAM)?;
                crate::socket_file::clear_stale(&side, rustix::net::SocketType::SEQPACKET)?;
                let hub = crate::transport::shm::ShmHub::bind(side.clone(), config.shm, config.socket_access)?;
                let l = bind_unix(path, &config.socket_access)?;
                crate::shutdown::remove_at_forced_exit(path);
                crate::shutdown::remove_at_forced_exit(&side);
                (Listener::Unix(l, path.clone()), Some(hub))
            }
            Address::Tcp(hp) | Address::Tls(hp) => {
                security = config.remote.check(hp)?;
                if matches!(config.listen, Address::Tls(_)) && security.tls.is_none() {
                    return Err(Error::invalid(format!(
                        "{}: a tls:// listener needs --tls-cert and --tls-key",
                        config.listen
                    )));
                }
                (Listener::Tcp(TcpListener::bind(hp).await.map_err(|e| Error::io("cannot listen on", hp, e))?), None)
            }
        };
        let rdma = match &config.rdma {
            Some(provider) => {
                let (p, budget) = (provider.clone(), config.rdma_budget);
                let hub = tokio::task::spawn_blocking(move || crate::transport::rdma::RdmaHub::start(p, budget))
                    .await
                    .map_err(|e| Error::Internal(format!("rdma start-up failed: {e}")))??;
                tracing::info!(provider = %hub.opened, "serving transport=\"rdma\"");
                Some(Arc::new(hub))
            }
            None => None,
        };
        if matches!(config.listen, Address::Unix(_)) && config.remote.any() {
            tracing::warn!("--tls-*, --tokens and --insecure apply to TCP listeners only; ignored on a Unix socket");
        }
        // Opened (and locked) here, after the listener (whose errors, such as a socket directory
        // the daemon may not write, come first) and before anyone is served: a daemon whose cache
        // another one holds fails in `bind`, naming it, and its socket goes again. An embedded
        // server's caller gets that error; opened later, it showed a connection that failed.
        let mut unbind = Unbind(match &listener {
            Listener::Unix(_, path) => Some(path.clone()),
            Listener::Tcp(_) => None,
        });
        let (dir, size, policy) = (config.cache_dir.clone(), config.cache_size, config.cache_policy);
        let cache = tokio::task::spawn_blocking(move || crate::cache::NodeCache::open(&dir, size, policy))
            .await
            .map_err(|e| Error::Internal(format!("cache start-up failed: {e}")))??;
        // Outside --cache-size: bounded on its own (its module docs).
        let sidecars = config.cache_dir.join(sidecar_cache::DIR);
        let bound = sidecar_cache::bound(cache.stats().capacity);
        sidecar_cache::trim_in_background(sidecars, bound, Arc::downgrade(&cache));
        unbind.0 = None;
        Ok(Self { listener, security, shm, rdma, cache, config, metrics: Arc::default() })
    }

    /// The address clients use (with the real port when TCP port 0 was asked for).
    pub fn address(&self) -> Address {
        match &self.listener {
            Listener::Unix(_, p) => Address::Unix(p.clone()),
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) if self.security.tls.is_some() => Address::Tls(a.to_string()),
                Ok(a) => Address::Tcp(a.to_string()),
                Err(_) => self.config.listen.clone(),
            },
        }
    }

    /// Serves until `shutdown` is cancelled, then lets in-flight streams end.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        // A start that fails before serving (metrics port taken) removes the socket it bound: left behind, `status` said "connection refused" until
        // the next start replaced it as stale. Disarmed once serving, when the path may be
        // another daemon's by the time this one ends.
        let mut unbind = Unbind(match &self.listener {
            Listener::Unix(_, path) => Some(path.clone()),
            Listener::Tcp(_) => None,
        });
        if let Some(addr) = self.config.metrics_addr {
            crate::metrics::install_exporter(addr)?;
            tracing::info!(%addr, "serving prometheus metrics");
            // The cache's gauges were set as it opened, before there was an exporter to keep them.
            self.cache.publish_gauges();
            crate::metrics::budgets(
                self.shm.as_ref().map_or(self.config.shm.packed_budget, |h| h.packed_budget().1),
                self.rdma.as_ref().map_or(0, |h| h.staging.limit()),
                self.config.inline_budget,
            );
        }
        let cfg = &self.config;
        let cache = self.cache.clone();
        cache.set_keep_derived(cfg.keep_decoded);
        crate::format::parquet::decoded::shared().set_budget(cfg.decoded_budget);
        // A copy the cache unlinks is not kept on disk by the row groups decoded over it.
        cache.on_removed(|copy| {
            let n = crate::format::parquet::decoded::shared().forget_copy(copy);
            if n > 0 {
                tracing::debug!(row_groups = n, "let go of the decoded row groups over an evicted node-cache copy");
            }
        });
        let prefetch = crate::prefetch::Prefetcher::start(cache.clone(), self.shm.clone(), cfg.prefetch.clone())?;
        // Decoded row groups no stream has used for a while go, so that an idle daemon does not
        // hold up to --decoded-budget for datasets served long ago (or deleted since).
        let releasing = tokio::spawn(async {
            use crate::format::parquet::decoded;
            let mut every = tokio::time::interval(std::time::Duration::from_secs(60));
            loop {
                every.tick().await;
                // Blocking: what it lets go of may unmap kept files.
                let released = tokio::task::spawn_blocking(|| {
                    decoded::shared().release_unused(std::time::Instant::now(), decoded::UNUSED_FOR)
                })
                .await
                .unwrap_or(0);
                if released > 0 {
                    tracing::debug!(bytes = released, "let go of decoded row groups no stream has used lately");
                }
            }
        });
        // A stream waiting for cache room (up to minutes) would outlast the drain.
        let waits = cache.clone();
        let draining = shutdown.clone();
        let stop_waits = tokio::spawn(async move {
            draining.cancelled().await;
            waits.stop_waits();
        });
        let node_cache = cache.clone();
        let backends =
            Arc::new(crate::index::Backends::new(Some(cache), cfg.s3.clone(), Some(tokio::runtime::Handle::current())));
        let registry = Arc::new(Registry::new(Some(cfg.cache_dir.clone()), backends.clone()));
        if cfg.allow.is_some() {
            // Before the first request: every dataset is listed and opened confined.
            crate::storage::confine::confine();
        }
        let service = Service::new(
            registry,
            self.metrics.clone(),
            shutdown.clone(),
            self.config.cache_dir.display().to_string(),
            self.shm.clone(),
            Some(prefetch.clone()),
        )
        .with_access(cfg.allow.clone())
        .with_rdma(self.rdma.clone())
        .with_max_streams(cfg.max_streams)
        .with_max_streams_per_client(cfg.max_streams_per_client)
        .with_inline_budget(cfg.inline_budget);
        let auth = match self.listener {
            Listener::Unix(..) => crate::remote::Authenticator::unix(),
            Listener::Tcp(_) => crate::remote::Authenticator::tcp(self.security.tokens.clone()),
        };
        // Requests are small: the decoding limit is the largest request any RPC takes, and each
        // RPC checks its own, tighter bound (limits::request_limit). Only replies are large.
        let svc = ShardstreamServer::new(service)
            .max_decoding_message_size(crate::limits::MAX_REQUEST_BYTES)
            .max_encoding_message_size(shardstream_proto::MAX_MESSAGE_BYTES);
        let svc = tonic::service::interceptor::InterceptedService::new(svc, auth);
        let mut builder = tonic::transport::Server::builder();
        if let Listener::Tcp(_) = self.listener {
            // A remote trainer cut off never sends a reset: its stream would hold its place
            // (consumer slot, leased shards) for good. Local ones are watched by the kernel.
            builder = builder
                .http2_keepalive_interval(Some(self.config.remote.tcp_timeout))
                .http2_keepalive_timeout(Some(self.config.remote.tcp_timeout));
        }
        let router = builder
            .initial_stream_window_size(shardstream_client::STREAM_WINDOW)
            .initial_connection_window_size(shardstream_client::CONNECTION_WINDOW)
            .max_frame_size(shardstream_client::MAX_FRAME_SIZE)
            .add_service(svc);
        let address = self.address();
        tracing::info!(%address, cache_dir = %self.config.cache_dir.display(), "serving");
        let drain = self.config.drain_timeout;
        let notify = self.config.sd_notify;
        // STOPPING=1 inside the server's own shutdown signal: the server polls it before it
        // drains, so the message goes out even when the drain is instant.
        let stopping = shutdown.clone();
        let signal = async move {
            stopping.cancelled().await;
            if notify {
                crate::notify::notify("STOPPING=1");
            }
        };
        let deadline = async {
            shutdown.cancelled().await;
            tokio::time::sleep(drain).await;
        };
        type Serving = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), tonic::transport::Error>> + Send>>;
        let limits = crate::accept::Limits { timeout: self.config.remote.tcp_timeout, shutdown: shutdown.clone() };
        let (serve, socket): (Serving, _) = match self.listener {
            // Connections are accepted, and TLS ones' handshakes done, by `accept`: each with
            // --tcp-timeout to start speaking HTTP/2 (tonic's own TLS accept, and hyper's wait for
            // a preface, wait forever).
            Listener::Unix(l, path) => {
                (Box::pin(router.serve_with_incoming_shutdown(crate::accept::unix(l, limits), signal)), Some(path))
            }
            Listener::Tcp(l) => {
                let serve: Serving = match self.security.tls.clone() {
                    Some(tls) => {
                        Box::pin(router.serve_with_incoming_shutdown(crate::accept::tls(l, tls, limits), signal))
                    }
                    None => Box::pin(router.serve_with_incoming_shutdown(crate::accept::plaintext(l, limits), signal)),
                };
                (serve, None)
            }
        };
        unbind.0 = None;
        if notify {
            // Connections made from now on are served (they queue in the backlog until the
            // server's first poll, a moment later).
            crate::notify::notify("READY=1");
        }
        let served = tokio::select! {
            r = serve => r.map_err(|e| Error::Unavailable(format!("server on {address} failed: {e}"))),
            _ = deadline => {
                tracing::warn!(timeout_s = drain.as_secs_f64(), "clients did not finish in time, exiting anyway");
                Ok(())
            }
        };
        if let Some(path) = socket {
            let _ = std::fs::remove_file(path);
            // From here the path may be another daemon's: a second signal removes nothing.
            crate::shutdown::forget_registered();
        }
        // Fetches still running (the prefetcher's threads are not joined) fail from now on
        // instead of retrying on a runtime about to go; the prefetcher first, so that it takes
        // their failures for the stop they are, not for warnings.
        prefetch.stop();
        backends.close();
        // Serving may have ended without a shutdown (the server failed): the task holds the cache.
        stop_waits.abort();
        releasing.abort();
        if served.is_ok() {
            // Only a clean exit vouches for the derived entries written unsynced (cache docs).
            let closed = tokio::task::spawn_blocking(move || node_cache.close()).await;
            match closed {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "node cache not closed cleanly: its decoded row groups go at the next start")
                }
                Err(e) => tracing::warn!(error = %e, "node cache close failed"),
            }
        }
        served
    }
}

/// Removes a Unix socket this daemon bound, when dropped armed.
struct Unbind(Option<std::path::PathBuf>);

impl Drop for Unbind {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn bind_unix(path: &Path, access: &crate::socket_file::SocketAccess) -> Result<UnixListener> {
    let fd = crate::socket_file::listen(path, rustix::net::SocketType::STREAM, access, 1024)?;
    let std_listener = std::os::unix::net::UnixListener::from(fd);
    std_listener.set_nonblocking(true).map_err(|e| Error::io("cannot set up", path, e))?;
    UnixListener::from_std(std_listener).map_err(|e| Error::io("cannot listen on", path, e))
}

/// The token that stops a daemon (re-exported so embedders need no tokio-util dependency).
pub use tokio_util::sync::CancellationToken as ShutdownToken;

#[cfg(test)]
mod tests {
    use super::*;

    /// `serve --listen` at a path holding a user's file once deleted the file (`Path::exists`,
    /// then `remove_file` of whatever was there). It is an error now, and the file stays.
    #[tokio::test]
    async fn a_listen_path_that_is_not_a_socket_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("important.txt");
        std::fs::write(&path, b"keep me").unwrap();
        let config = DaemonConfig::new(Address::Unix(path.clone()), dir.path().join("cache"));
        let err = BoundDaemon::bind(config).await.err().expect("binding over a regular file must fail").to_string();
        assert!(err.contains("not a socket") && err.contains("important.txt"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"keep me");
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run").join("sock");
        let config = DaemonConfig::new(Address::Unix(path.clone()), dir.path().join("cache"));
        let first = BoundDaemon::bind(config.clone()).await.unwrap();
        // Dropped without `run`: its socket files stay behind, as after a crash.
        drop(first);
        let second = BoundDaemon::bind(config).await.unwrap();
        assert_eq!(second.address(), Address::Unix(path));
    }
}
