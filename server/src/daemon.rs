//! Binding a listener and serving the gRPC service until shutdown. Used by `shardstream serve` and
//! by the Python package's embedded server alike, so both run the same code.
//!
//! The Unix socket is created owner-only (mode 0600) inside a directory this process creates with
//! mode 0700 when it does not exist: nobody else on the node can connect. A stale socket left by a
//! crashed daemon is replaced; a live one (another daemon answers) is an error, and so is anything
//! at the path that is not a socket ([`crate::socket_file`]).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use shardstream_client::Address;
use shardstream_proto::shardstream_server::ShardstreamServer;
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;

use crate::index::Registry;
use crate::metrics::Metrics;
use crate::service::Service;
use crate::{Error, Result};

/// Mode of the Unix socket: owner only. Trainers run as the daemon's user (sidecar, per-job
/// daemon) or reach it through a group-owned directory set up by the operator.
const SOCKET_MODE: u32 = 0o600;

/// How long a shutdown waits for connections to finish before the daemon exits anyway: a client
/// that stopped reading must not keep a draining daemon alive.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub listen: Address,
    pub cache_dir: PathBuf,
    /// Node cache capacity in bytes; `None`: most of the cache file system's space.
    pub cache_size: Option<u64>,
    pub cache_policy: crate::cache::table::Policy,
    pub prefetch: crate::prefetch::PrefetchConfig,
    pub s3: crate::storage::s3::S3Options,
    /// Where to serve Prometheus metrics (`GET /metrics`), if anywhere.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Credits and ring slots of the shared-memory transport.
    pub shm: crate::transport::shm::ShmConfig,
}

impl DaemonConfig {
    /// A daemon on `listen` with its cache in `cache_dir` and every other setting at its default.
    pub fn new(listen: Address, cache_dir: PathBuf) -> Self {
        Self {
            listen,
            cache_dir,
            cache_size: None,
            cache_policy: crate::cache::table::Policy::Belady,
            prefetch: crate::prefetch::PrefetchConfig::default(),
            s3: crate::storage::s3::S3Options::default(),
            metrics_addr: None,
            shm: crate::transport::shm::ShmConfig::default(),
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
    shm: Option<Arc<crate::transport::shm::ShmHub>>,
    config: DaemonConfig,
    pub metrics: Arc<Metrics>,
}

impl BoundDaemon {
    /// Creates the cache directory and binds the listener.
    pub async fn bind(config: DaemonConfig) -> Result<Self> {
        std::fs::create_dir_all(&config.cache_dir)
            .map_err(|e| Error::io("cannot create cache directory", &config.cache_dir, e))?;
        let (listener, shm) = match &config.listen {
            Address::Unix(path) => {
                let l = bind_unix(path).await?;
                let side = crate::transport::shm::side_socket_path(path);
                let hub = crate::transport::shm::ShmHub::bind(side, config.shm)?;
                (Listener::Unix(l, path.clone()), Some(hub))
            }
            Address::Tcp(hp) => {
                (Listener::Tcp(TcpListener::bind(hp).await.map_err(|e| Error::io("cannot listen on", hp, e))?), None)
            }
        };
        Ok(Self { listener, shm, config, metrics: Arc::default() })
    }

    /// The address clients use (with the real port when TCP port 0 was asked for).
    pub fn address(&self) -> Address {
        match &self.listener {
            Listener::Unix(_, p) => Address::Unix(p.clone()),
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) => Address::Tcp(a.to_string()),
                Err(_) => self.config.listen.clone(),
            },
        }
    }

    /// Serves until `shutdown` is cancelled, then lets in-flight streams end.
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        if let Some(addr) = self.config.metrics_addr {
            crate::metrics::install_exporter(addr)?;
            tracing::info!(%addr, "serving prometheus metrics");
        }
        let cfg = &self.config;
        let (dir, size, policy) = (cfg.cache_dir.clone(), cfg.cache_size, cfg.cache_policy);
        let cache = tokio::task::spawn_blocking(move || crate::cache::NodeCache::open(&dir, size, policy))
            .await
            .map_err(|e| Error::Internal(format!("cache start-up failed: {e}")))??;
        let prefetch = crate::prefetch::Prefetcher::start(cache.clone(), self.shm.clone(), cfg.prefetch.clone())?;
        let backends =
            Arc::new(crate::index::Backends::new(Some(cache), cfg.s3.clone(), Some(tokio::runtime::Handle::current())));
        let registry = Arc::new(Registry::new(Some(cfg.cache_dir.clone()), backends));
        let service = Service::new(
            registry,
            self.metrics.clone(),
            shutdown.clone(),
            self.config.cache_dir.display().to_string(),
            self.shm.clone(),
            Some(prefetch.clone()),
        );
        let svc = ShardstreamServer::new(service)
            .max_decoding_message_size(shardstream_proto::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(shardstream_proto::MAX_MESSAGE_BYTES);
        let router = tonic::transport::Server::builder()
            .initial_stream_window_size(shardstream_client::STREAM_WINDOW)
            .initial_connection_window_size(shardstream_client::CONNECTION_WINDOW)
            .add_service(svc);
        let address = self.address();
        tracing::info!(%address, cache_dir = %self.config.cache_dir.display(), "serving");
        let signal = shutdown.clone().cancelled_owned();
        let deadline = async {
            shutdown.cancelled().await;
            tokio::time::sleep(DRAIN_TIMEOUT).await;
        };
        let (serve, socket): (std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>, _) = match self.listener {
            Listener::Unix(l, path) => {
                (Box::pin(router.serve_with_incoming_shutdown(UnixListenerStream::new(l), signal)), Some(path))
            }
            Listener::Tcp(l) => {
                (Box::pin(router.serve_with_incoming_shutdown(TcpListenerStream::new(l), signal)), None)
            }
        };
        let served = tokio::select! {
            r = serve => r.map_err(|e| Error::Unavailable(format!("server on {address} failed: {e}"))),
            _ = deadline => {
                tracing::warn!(timeout_s = DRAIN_TIMEOUT.as_secs(), "clients did not finish in time, exiting anyway");
                Ok(())
            }
        };
        if let Some(path) = socket {
            let _ = std::fs::remove_file(path);
        }
        prefetch.stop();
        served
    }
}

async fn bind_unix(path: &Path) -> Result<UnixListener> {
    // A relative `--listen sock` has the parent "": the working directory, which exists.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.try_exists().map_err(|e| Error::io("cannot inspect socket directory", dir, e))?
    {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create socket directory", dir, e))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::io("cannot restrict socket directory", dir, e))?;
    }
    if crate::socket_file::socket_exists(path)? {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(Error::Unavailable(format!("another daemon is already listening on {}", path.display())));
        }
        std::fs::remove_file(path).map_err(|e| Error::io("cannot remove stale socket", path, e))?;
    }
    let listener = UnixListener::bind(path).map_err(|e| Error::io("cannot listen on", path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
        .map_err(|e| Error::io("cannot restrict socket", path, e))?;
    Ok(listener)
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
        assert!(err.contains("regular file") && err.contains("important.txt"), "{err}");
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
