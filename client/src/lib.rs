//! Client of the shardstream daemon, without Python: parse an address, connect over a Unix socket
//! or TCP, open datasets and stream batches. The Python package and the `shardstream status` CLI
//! are both built on it.
//!
//! A remote daemon is reached over `tls://host:port` (or plaintext `tcp://` on loopback, when the
//! daemon runs with `--insecure`); [`Credentials`] come from the environment so that DataLoader
//! workers and every rank inherit them: `SHARDSTREAM_TLS_CA`, `SHARDSTREAM_TOKEN_FILE`, and for
//! mutual TLS `SHARDSTREAM_TLS_CLIENT_CERT` / `SHARDSTREAM_TLS_CLIENT_KEY`.
//!
//! A stream is drained by a background task into a small channel, so decoding the next batch
//! overlaps with the consumer's work on the current one.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use shardstream_proto::ring::IPC_ALIGN;
use shardstream_proto::shardstream_client::ShardstreamClient;
use shardstream_proto::{BatchFormat, DatasetInfo, OpenRequest, StreamHeader, StreamRequest, stream_message};
use tokio::sync::mpsc;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Uri};

pub use shardstream_proto as proto;

pub mod arrow;
pub mod arrow_join;
pub mod frames;
mod handoff;
pub mod inline;
pub mod parts;
pub mod rdma;
mod retained;
pub mod shm;

/// HTTP/2 flow-control windows. A batch of 256 x 20 KiB is 5 MiB; windows of several batches keep
/// the daemon sending while the client decodes (the 64 KiB default would stall every batch on
/// round trips).
pub const STREAM_WINDOW: u32 = 64 << 20;
pub const CONNECTION_WINDOW: u32 = 256 << 20;

/// Largest HTTP/2 frame either end accepts (RFC 9113 allows up to 16 MiB - 1; the default is 16
/// KiB). A batch message of up to 8 MiB crosses in one DATA frame, which [`frames`] decodes in
/// place; a larger one is joined with one copy. Not larger: h2 reads every frame into a fresh
/// buffer of its size, and for batches that are joined anyway, bigger frames only cost page
/// faults (1 MiB samples in batches of 16 ran 0.68x with 16 MiB frames, bench/INLINE.md).
pub const MAX_FRAME_SIZE: u32 = 8 << 20;

/// Batches decoded ahead of the consumer: a batch of samples in shared memory is a small
/// descriptor, an inline one holds its bytes.
const CLIENT_QUEUE: usize = 4;
const CLIENT_QUEUE_SHM: usize = 8;

/// Once the queue is full, the receiving task waits for half of it to be free, not for one place:
/// woken for each batch taken, it cost the trainer a thread switch a batch (the client's runtime
/// thread was ~8% of the CPU of an epoch of small samples, bench/PROFILES.md). Woken once the
/// consumer has taken half, it passes that many on in one go.
fn refill(queue: usize) -> usize {
    (queue / 2).max(1)
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid daemon address {0:?}: expected unix:///path/to/socket, tls://host:port or tcp://host:port")]
    BadAddress(String),
    /// Client settings of the environment that cannot be used (a missing TLS or token file, a
    /// token for plaintext, a `SHARDSTREAM_TCP_TIMEOUT` that is not a number of seconds).
    #[error("{0}")]
    Credentials(String),
    #[error("cannot connect to the shardstream daemon at {addr}: {}", error_chain(.source))]
    Connect {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// Connected, but the first request got no shardstream answer.
    #[error("no shardstream daemon answered at {addr} ({detail}): {hint}")]
    NoAnswer { addr: String, detail: String, hint: &'static str },
    /// The daemon's Unix socket does not let this user connect: no retry changes that.
    #[error(
        "permission denied connecting to the shardstream daemon at {addr}: its socket does not let \
         this user in (the daemon's --socket-mode and --socket-group say who may connect)"
    )]
    Refused { addr: String },
    /// An error the daemon reported (its status code says which kind).
    #[error("{}", .0.message())]
    Status(tonic::Status),
    /// The connection to the daemon broke: it died (SIGKILL, crash, OOM), the socket was reset,
    /// the HTTP/2 connection failed, or the shared-memory side channel reached EOF. Never a
    /// verdict on the request: the same request may succeed against a restarted daemon.
    #[error("lost the connection to the shardstream daemon: {0}")]
    Disconnected(String),
    /// A shard read in place changed under the client (truncated while a batch used it).
    #[error("shard {shard}: {reason}")]
    Shard { shard: String, offset: Option<u64>, reason: String },
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("shared-memory transport: {0}")]
    Shm(String),
    /// transport="rdma" could not be had or failed (no libfabric, no provider, registration
    /// refused by the memlock limit, the daemon's writes failed).
    #[error("rdma transport: {0}")]
    Rdma(String),
}

impl From<tonic::Status> for ClientError {
    /// Statuses made on this side from a broken connection (h2/hyper/socket errors) become
    /// [`ClientError::Disconnected`]; statuses the daemon sent stay [`ClientError::Status`].
    fn from(s: tonic::Status) -> Self {
        if is_transport_failure(&s) {
            // A channel that reconnects to a Unix socket the daemon removed as it stopped.
            let gone = if socket_gone(&s) { "the daemon's socket is gone (it stopped): " } else { "" };
            ClientError::Disconnected(format!("{gone}{:?}: {}", s.code(), s.message()))
        } else {
            ClientError::Status(s)
        }
    }
}

/// True when `s` was made locally from a transport failure rather than received from the
/// daemon. tonic turns a connection that dies mid-stream into `Unknown: h2 protocol error` (or
/// `Unavailable`, `Internal`, `Cancelled`), always with the underlying error as its source; a
/// status received in trailers never has a source.
pub fn is_transport_failure(s: &tonic::Status) -> bool {
    causes(s).any(|e| {
        e.is::<h2::Error>() || e.is::<hyper::Error>() || e.is::<std::io::Error>() || e.is::<tonic::transport::Error>()
    })
}

/// The errors behind `s`, nearest first.
fn causes(s: &tonic::Status) -> impl Iterator<Item = &(dyn std::error::Error + 'static)> {
    std::iter::successors(std::error::Error::source(s), |e| e.source())
}

/// Whether `s` failed on a Unix socket path that no longer exists (ENOENT at connect).
fn socket_gone(s: &tonic::Status) -> bool {
    causes(s).any(|e| e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::NotFound))
}

/// An error and its causes, so "transport error" says which (e.g. "invalid peer certificate:
/// UnknownIssuer"); a cause whose text the chain already holds is not repeated. The daemon words
/// its S3 SDK errors with it too.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// Where a daemon listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Unix(PathBuf),
    /// Plaintext TCP: only for a daemon started with `--insecure` on loopback.
    Tcp(String),
    /// TCP with TLS.
    Tls(String),
}

impl FromStr for Address {
    type Err = ClientError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ClientError::BadAddress(s.to_owned());
        if let Some(path) = s.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(bad());
            }
            return Ok(Address::Unix(PathBuf::from(path)));
        }
        for (scheme, tls) in [("tcp://", false), ("tls://", true)] {
            if let Some(hp) = s.strip_prefix(scheme) {
                let (host, port) = hp.rsplit_once(':').ok_or_else(bad)?;
                if host.is_empty() || port.parse::<u16>().is_err() {
                    return Err(bad());
                }
                return Ok(if tls { Address::Tls(hp.to_owned()) } else { Address::Tcp(hp.to_owned()) });
            }
        }
        if s.starts_with('/') {
            return Ok(Address::Unix(PathBuf::from(s)));
        }
        Err(bad())
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Unix(p) => write!(f, "unix://{}", p.display()),
            Address::Tcp(hp) => write!(f, "tcp://{hp}"),
            Address::Tls(hp) => write!(f, "tls://{hp}"),
        }
    }
}

/// A connection to the daemon: the generated client for every call but `StreamBatches`, whose
/// response [`frames`] reads off the same channel, with the same credentials, without copying
/// each frame (it derefs to the generated client).
#[derive(Clone)]
pub struct Client {
    rpc: ShardstreamClient<InterceptedService<Channel, Auth>>,
    channel: InterceptedService<Channel, Auth>,
    /// The daemon's address, for errors before it has answered once.
    addr: String,
}

impl Client {
    /// The error of a connection's first request (`open`, `status`): that is where a peer that
    /// is no shardstream daemon shows (a TLS port spoken to in plaintext, another service, a
    /// silent host), so a transport failure names the address.
    pub fn first_answer(&self, s: tonic::Status) -> ClientError {
        if is_transport_failure(&s) {
            let detail = match std::error::Error::source(&s).map(error_chain) {
                Some(chain) if !chain.contains(s.message()) => format!("{}: {chain}", s.message()),
                Some(chain) => chain,
                None => s.message().to_owned(),
            };
            no_answer(&self.addr, detail)
        } else {
            s.into()
        }
    }
}

impl std::ops::Deref for Client {
    type Target = ShardstreamClient<InterceptedService<Channel, Auth>>;
    fn deref(&self) -> &Self::Target {
        &self.rpc
    }
}

impl std::ops::DerefMut for Client {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.rpc
    }
}

/// Adds the bearer token (if any) to every request.
#[derive(Clone, Default)]
pub struct Auth(Option<tonic::metadata::AsciiMetadataValue>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

/// How to prove who we are to a remote daemon, and how to know it is the daemon.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    /// CA certificate (PEM) that signed the daemon's certificate (`tls://`).
    pub tls_ca: Option<PathBuf>,
    /// Name to verify the daemon's certificate against, when not the host of the address.
    pub tls_server_name: Option<String>,
    /// Client certificate and key (PEM), for a daemon that requires mutual TLS.
    pub tls_client_cert: Option<PathBuf>,
    pub tls_client_key: Option<PathBuf>,
    /// File holding the bearer token (its first line).
    pub token_file: Option<PathBuf>,
}

impl Credentials {
    /// From `SHARDSTREAM_TLS_CA`, `SHARDSTREAM_TLS_SERVER_NAME`, `SHARDSTREAM_TLS_CLIENT_CERT`,
    /// `SHARDSTREAM_TLS_CLIENT_KEY` and `SHARDSTREAM_TOKEN_FILE` (empty means unset).
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        Self {
            tls_ca: var("SHARDSTREAM_TLS_CA").map(PathBuf::from),
            tls_server_name: var("SHARDSTREAM_TLS_SERVER_NAME").and_then(|v| v.into_string().ok()),
            tls_client_cert: var("SHARDSTREAM_TLS_CLIENT_CERT").map(PathBuf::from),
            tls_client_key: var("SHARDSTREAM_TLS_CLIENT_KEY").map(PathBuf::from),
            token_file: var("SHARDSTREAM_TOKEN_FILE").map(PathBuf::from),
        }
    }

    /// The `authorization` value to send to `addr`, if a token is configured. A token is never
    /// sent in plaintext beyond loopback (a mistyped `tcp://` must not leak it).
    fn bearer(&self, addr: &Address) -> Result<Option<tonic::metadata::AsciiMetadataValue>, ClientError> {
        let Some(path) = &self.token_file else { return Ok(None) };
        if let Address::Unix(_) = addr {
            return Ok(None);
        }
        if let Address::Tcp(hp) = addr
            && !is_loopback(hp)
        {
            return Err(ClientError::Credentials(format!(
                "refusing to send the bearer token (SHARDSTREAM_TOKEN_FILE) in plaintext to {addr}: use tls://{hp}"
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| {
            ClientError::Credentials(format!(
                "cannot read the token file {} (SHARDSTREAM_TOKEN_FILE): {e}",
                path.display()
            ))
        })?;
        let token = text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or_default();
        let mut v: tonic::metadata::AsciiMetadataValue = format!("Bearer {token}").parse().map_err(|_| {
            ClientError::Credentials(format!("the token file {} holds no usable token", path.display()))
        })?;
        if token.is_empty() {
            return Err(ClientError::Credentials(format!("the token file {} is empty", path.display())));
        }
        v.set_sensitive(true);
        Ok(Some(v))
    }

    fn tls(&self, host: &str) -> Result<ClientTlsConfig, ClientError> {
        let read = |p: &PathBuf, var: &str| {
            std::fs::read(p).map_err(|e| ClientError::Credentials(format!("cannot read {} ({var}): {e}", p.display())))
        };
        let ca = self.tls_ca.as_ref().ok_or_else(|| {
            ClientError::Credentials(
                "a tls:// address needs the daemon's CA certificate: set SHARDSTREAM_TLS_CA to its PEM file".into(),
            )
        })?;
        let name = self
            .tls_server_name
            .clone()
            .unwrap_or_else(|| host.trim_start_matches('[').trim_end_matches(']').to_owned());
        let pem = read(ca, "SHARDSTREAM_TLS_CA")?;
        if !pem.windows(CERTIFICATE_BEGIN.len()).any(|w| w == CERTIFICATE_BEGIN) {
            // Else every handshake fails as "UnknownIssuer", a ConnectionError naming no file.
            return Err(ClientError::Credentials(format!(
                "{} (SHARDSTREAM_TLS_CA) holds no PEM certificate (no \"-----BEGIN CERTIFICATE-----\" line): \
                 give the daemon's CA certificate",
                ca.display()
            )));
        }
        let mut cfg = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)).domain_name(name);
        match (&self.tls_client_cert, &self.tls_client_key) {
            (Some(c), Some(k)) => {
                let (cert, key) = (read(c, "SHARDSTREAM_TLS_CLIENT_CERT")?, read(k, "SHARDSTREAM_TLS_CLIENT_KEY")?);
                check_identity(c, &cert, k, &key)?;
                cfg = cfg.identity(Identity::from_pem(cert, key));
            }
            (None, None) => {}
            _ => {
                return Err(ClientError::Credentials(
                    "SHARDSTREAM_TLS_CLIENT_CERT and SHARDSTREAM_TLS_CLIENT_KEY go together".into(),
                ));
            }
        }
        Ok(cfg)
    }
}

/// Refuses a client certificate and key that cannot make a handshake, naming the file and its
/// setting. Left to the handshake, a file holding no certificate was skipped (the daemon then
/// refused "no certificates", as if it had sent none) and a bad key failed every connection: each
/// a `ConnectionError` naming no setting, which a loop retrying `ConnectionError` retries for good.
fn check_identity(cert_path: &Path, cert: &[u8], key_path: &Path, key: &[u8]) -> Result<(), ClientError> {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ClientError::Credentials(format!("{} (SHARDSTREAM_TLS_CLIENT_CERT): {e}", cert_path.display())))?;
    if chain.is_empty() {
        return Err(ClientError::Credentials(format!(
            "{} (SHARDSTREAM_TLS_CLIENT_CERT) holds no PEM certificate (no \"-----BEGIN CERTIFICATE-----\" line): \
             give this client's certificate",
            cert_path.display()
        )));
    }
    let private = PrivateKeyDer::from_pem_slice(key).map_err(|e| {
        ClientError::Credentials(format!(
            "{} (SHARDSTREAM_TLS_CLIENT_KEY) holds no usable private key (PEM \"PRIVATE KEY\", \"RSA PRIVATE KEY\" \
             or \"EC PRIVATE KEY\"): {e}",
            key_path.display()
        ))
    })?;
    // The same check rustls makes when the handshake would use them (the key's public half is the
    // certificate's), made now.
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::Credentials(format!("TLS settings: {e}")))?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(chain, private)
        .map_err(|e| {
            ClientError::Credentials(format!(
                "{} (SHARDSTREAM_TLS_CLIENT_KEY) is not the key of the certificate {} \
                 (SHARDSTREAM_TLS_CLIENT_CERT): {e}",
                key_path.display(),
                cert_path.display()
            ))
        })?;
    Ok(())
}

/// What a PEM certificate begins with (a key, a token or a DER file has none).
const CERTIFICATE_BEGIN: &[u8] = b"-----BEGIN CERTIFICATE-----";

/// True when `host:port` is a loopback address (an IP, or a name resolving only to loopback).
pub fn is_loopback(host_port: &str) -> bool {
    use std::net::ToSocketAddrs;
    let Some((host, _)) = host_port.rsplit_once(':') else { return false };
    if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    match host_port.to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<_> = addrs.collect();
            !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback())
        }
        Err(_) => false,
    }
}

/// [`ClientError::Refused`] when the socket refused this user (EACCES), else
/// [`ClientError::Connect`].
fn connect_error(addr: &Address, source: tonic::transport::Error) -> ClientError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&source);
    while let Some(e) = cause {
        if e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied) {
            return ClientError::Refused { addr: addr.to_string() };
        }
        cause = e.source();
    }
    ClientError::Connect { addr: addr.to_string(), source }
}

/// Connects to a daemon (waits for the connection, so a missing daemon is an error here), with
/// the credentials of the environment ([`Credentials::from_env`]).
pub async fn connect(addr: &Address) -> Result<Client, ClientError> {
    connect_with(addr, &Credentials::from_env()).await
}

/// Connects to a daemon with the given credentials.
pub async fn connect_with(addr: &Address, creds: &Credentials) -> Result<Client, ClientError> {
    connect_inner(addr, creds, None).await
}

/// [`connect`] for a caller that may wait long for answers (`shardstream prefetch`): on a Unix
/// socket too, a daemon that answers no HTTP/2 PING within `silence` (stopped, or not a daemon
/// at all) ends the call with [`ClientError::Disconnected`], where the kernel would say nothing.
/// Trainers' streams do without: their waits are bounded by what they wait for.
pub async fn connect_watched(addr: &Address, silence: Duration) -> Result<Client, ClientError> {
    connect_inner(addr, &Credentials::from_env(), Some(silence)).await
}

async fn connect_inner(addr: &Address, creds: &Credentials, silence: Option<Duration>) -> Result<Client, ClientError> {
    let connect_err = |source| connect_error(addr, source);
    let auth = Auth(creds.bearer(addr)?);
    let channel = match addr {
        Address::Tcp(hp) => {
            let timeout = tcp_timeout()?;
            let endpoint = remote(Endpoint::from_shared(format!("http://{hp}")).map_err(connect_err)?, timeout);
            within(addr, timeout, endpoint.connect()).await?.map_err(connect_err)?
        }
        Address::Tls(hp) => {
            let host = hp.rsplit_once(':').map_or(hp.as_str(), |(h, _)| h);
            let tls = creds.tls(host)?;
            let timeout = tcp_timeout()?;
            let endpoint = remote(Endpoint::from_shared(format!("https://{hp}")).map_err(connect_err)?, timeout)
                .tls_config(tls)
                .map_err(connect_err)?;
            within(addr, timeout, endpoint.connect()).await?.map_err(connect_err)?
        }
        Address::Unix(path) => {
            let path = path.clone();
            // The URI is required by the API but unused: the connector dials the socket.
            let endpoint = match silence {
                Some(s) => tuned(Endpoint::from_static("http://localhost"))
                    .http2_keep_alive_interval(s)
                    .keep_alive_timeout(s)
                    .keep_alive_while_idle(true),
                None => tuned(Endpoint::from_static("http://localhost")),
            };
            endpoint
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
                }))
                .await
                .map_err(connect_err)?
        }
    };
    let rpc = ShardstreamClient::with_interceptor(channel.clone(), auth.clone())
        .max_decoding_message_size(shardstream_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(shardstream_proto::MAX_MESSAGE_BYTES);
    Ok(Client { rpc, channel: InterceptedService::new(channel, auth), addr: addr.to_string() })
}

/// `connect`, given up after `timeout`: the endpoint's connect timeout bounds the TCP connect
/// alone, and a peer that accepts and then says nothing (a frozen daemon, whose kernel still
/// completes connects from the listen backlog) held the TLS handshake, and with it the trainer,
/// for good. HTTP/2 pings only watch a connection once it is made.
async fn within<T>(addr: &Address, timeout: Duration, connect: impl Future<Output = T>) -> Result<T, ClientError> {
    tokio::time::timeout(timeout, connect).await.map_err(|_| {
        let detail = format!(
            "connected, but no TLS handshake or HTTP/2 answer within {} s (SHARDSTREAM_TCP_TIMEOUT)",
            timeout.as_secs()
        );
        no_answer(&addr.to_string(), detail)
    })
}

/// [`ClientError::NoAnswer`] with what to check for this kind of address. A daemon that refuses
/// a client certificate (none sent, expired, of another CA) does so in a TLS 1.3 alert that
/// arrives with the first request, often as a broken pipe or a closed connection instead: the
/// hint names client certificates for every `tls://` address, and says it plainly when the alert
/// came through.
fn no_answer(addr: &str, detail: String) -> ClientError {
    let hint = if !addr.starts_with("tls://") {
        "is it a tls:// listener, another service, or a host that does not answer?"
    } else if detail.contains("Certificate") || detail.contains("UnknownCA") {
        "the daemon refused this client's certificate, or its lack of one: it requires a client \
         certificate (--tls-client-ca) signed by a CA it trusts and not expired; this client sends the \
         one SHARDSTREAM_TLS_CLIENT_CERT and SHARDSTREAM_TLS_CLIENT_KEY name"
    } else {
        "is it a shardstream tls:// listener, a host that does not answer, or a daemon that requires a \
         client certificate (--tls-client-ca) this client does not send or that it refuses \
         (SHARDSTREAM_TLS_CLIENT_CERT and SHARDSTREAM_TLS_CLIENT_KEY name the one sent)?"
    };
    ClientError::NoAnswer { addr: addr.to_owned(), detail, hint }
}

/// How long a remote daemon may stay silent before the client gives up on it, unless
/// `SHARDSTREAM_TCP_TIMEOUT` says otherwise: a TCP connect, and an HTTP/2 PING's answer sent
/// after as long without one (so a host cut off or powered off, which never sends a reset, is a
/// [`ClientError::Disconnected`] within two of these). The daemon pings its TCP clients likewise.
pub const TCP_TIMEOUT: Duration = Duration::from_secs(20);

/// [`TCP_TIMEOUT`], or `SHARDSTREAM_TCP_TIMEOUT` seconds (from 1 to 3600).
fn tcp_timeout() -> Result<Duration, ClientError> {
    let Some(v) = std::env::var_os("SHARDSTREAM_TCP_TIMEOUT").filter(|v| !v.is_empty()) else {
        return Ok(TCP_TIMEOUT);
    };
    let text = v.to_string_lossy();
    match text.trim().parse::<u64>() {
        Ok(s @ 1..=3600) => Ok(Duration::from_secs(s)),
        _ => Err(ClientError::Credentials(format!(
            "SHARDSTREAM_TCP_TIMEOUT must be a whole number of seconds from 1 to 3600, not {text:?}"
        ))),
    }
}

/// A TCP endpoint that notices a silent peer ([`TCP_TIMEOUT`]).
fn remote(e: Endpoint, timeout: Duration) -> Endpoint {
    tuned(e)
        .connect_timeout(timeout)
        .http2_keep_alive_interval(timeout)
        .keep_alive_timeout(timeout)
        .keep_alive_while_idle(true)
}

fn tuned(e: Endpoint) -> Endpoint {
    e.initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME_SIZE)
        .tcp_nodelay(true)
}

/// Opens a dataset. `cache`: how its shards are read ("direct", "copy", or "" for the daemon's
/// choice: through the node cache for S3, in place for file systems).
pub async fn open(client: &mut Client, url: &str, cache: &str) -> Result<DatasetInfo, ClientError> {
    let req = OpenRequest {
        url: url.to_owned(),
        protocol_version: shardstream_proto::PROTOCOL_VERSION,
        cache: cache.to_owned(),
    };
    client.rpc.open_dataset(req).await.map(|r| r.into_inner()).map_err(|s| client.first_answer(s))
}

/// A received batch: bytes inline, descriptors into shards mapped through `shm`, a slot of the
/// stream's ring (packed mode), or rows of an Arrow dataset (Parquet) as one Arrow IPC stream,
/// inline or in a ring slot ([`shm::RingMapping::arrow_ipc`]).
#[derive(Debug)]
pub enum Batch {
    Inline(shardstream_proto::InlineBatch),
    Shm(shardstream_proto::ShmBatch),
    Packed(shardstream_proto::PackedBatch),
    Arrow(shardstream_proto::ArrowBatch),
}

impl Batch {
    /// Index of the batch in the rank's batch order.
    pub fn index(&self) -> u64 {
        match self {
            Batch::Inline(b) => b.batch_index,
            Batch::Shm(b) => b.batch_index,
            Batch::Packed(b) => b.batch_index,
            Batch::Arrow(b) => b.batch_index,
        }
    }

    /// True when the batch holds a lease or slot that must be released (shared memory). An
    /// `ArrowBatch` over shared memory names a ring slot and carries no bytes; inline, its IPC
    /// stream (never empty: it holds at least the schema message) is in `data`.
    pub fn is_leased(&self) -> bool {
        match self {
            Batch::Inline(_) => false,
            Batch::Arrow(b) => b.data.is_empty(),
            Batch::Shm(_) | Batch::Packed(_) => true,
        }
    }
}

/// The batches one `ArrowBatch` message carries, as `(index, rows)` in row order: the message
/// itself when it names no parts. Checked against the wire contract (`part_indices[0]` is the
/// message's index, indices increase, rows add up to the message's, at most `allowed` parts), so
/// a caller can slice the record batch by these counts without checking again.
pub fn arrow_parts(b: &shardstream_proto::ArrowBatch, allowed: u32) -> Result<Vec<(u64, u32)>, ClientError> {
    let bad = |why: String| Err(ClientError::Protocol(format!("arrow batch {}: {why}", b.batch_index)));
    if b.part_indices.is_empty() && b.part_rows.is_empty() {
        let rows = u32::try_from(b.row_ids.len());
        return match rows {
            Ok(rows) => Ok(vec![(b.batch_index, rows)]),
            Err(_) => bad(format!("{} rows in one batch", b.row_ids.len())),
        };
    }
    if b.part_indices.len() != b.part_rows.len() {
        return bad(format!("{} part indices but {} part row counts", b.part_indices.len(), b.part_rows.len()));
    }
    let allowed = allowed.max(1);
    if b.part_indices.len() > allowed as usize {
        return bad(format!("{} batches in one message, more than the {allowed} asked for", b.part_indices.len()));
    }
    if b.part_indices.first() != Some(&b.batch_index) {
        return bad(format!("its first part is batch {:?}", b.part_indices.first()));
    }
    if b.part_indices.windows(2).any(|w| w[0] >= w[1]) {
        return bad(format!("part indices {:?} do not increase", b.part_indices));
    }
    let rows: u64 = b.part_rows.iter().map(|&r| u64::from(r)).sum();
    if rows != b.row_ids.len() as u64 {
        return bad(format!("parts of {rows} rows in all, but {} row ids", b.row_ids.len()));
    }
    Ok(b.part_indices.iter().copied().zip(b.part_rows.iter().copied()).collect())
}

/// `data` itself when it starts at a multiple of [`IPC_ALIGN`], else a copy that does: a reader
/// hands out Arrow arrays (and numpy or torch views of them) where they lie in the stream. An
/// inline message's IPC stream lies wherever the protobuf decoder found it in the receive
/// buffer; a slot (shm, rdma) starts on a page.
pub fn aligned_ipc(data: bytes::Bytes) -> bytes::Bytes {
    let misalign = |p: *const u8| (p as usize) % IPC_ALIGN;
    if misalign(data.as_ptr()) == 0 {
        return data;
    }
    let mut v = Vec::with_capacity(data.len() + IPC_ALIGN);
    let pad = (IPC_ALIGN - misalign(v.as_ptr())) % IPC_ALIGN;
    v.resize(pad, 0);
    v.extend_from_slice(&data);
    bytes::Bytes::from(v).slice(pad..)
}

/// One consumer's stream of batches.
pub struct BatchStream {
    pub header: StreamHeader,
    /// The attached side channel, when the stream uses shared memory.
    pub shm: Option<std::sync::Arc<shm::ShmSession>>,
    /// The registered ring, when the stream uses rdma.
    pub rdma: Option<std::sync::Arc<rdma::RdmaRing>>,
    rx: mpsc::Receiver<Result<Batch, ClientError>>,
    task: tokio::task::JoinHandle<()>,
    /// What the task has put into `rx`, and whether the stream is gone (see [`handoff`]).
    handoff: std::sync::Arc<handoff::Handoff>,
}

impl BatchStream {
    /// Next batch; `None` at the end of the stream.
    pub async fn next(&mut self) -> Option<Result<Batch, ClientError>> {
        if let Ok(item) = self.rx.try_recv() {
            return Some(item);
        }
        // About to wait: the daemon may be waiting for the slots of releases held back, and
        // batches dropped meanwhile (by other threads) must not be held back either.
        let _waiting = self.shm.as_ref().map(|shm| shm.waiting());
        self.rx.recv().await
    }

    /// When every credit of the stream is held by batches not released yet, `(held, credits)`:
    /// the daemon can make no batch until one is, so a wait for the next can last for good.
    /// Credits are the leases a shared-memory client may hold (`shm_credits`) and, for packed
    /// and Arrow batches, the slots of their ring; over rdma, the slots of the registered ring.
    /// The end of the stream needs none.
    pub fn held_every_credit(&self) -> Option<(usize, u32)> {
        if let Some(ring) = &self.rdma {
            let (held, slots) = ring.held();
            return (slots > 0 && held >= slots as usize).then_some((held, slots));
        }
        let shm = self.shm.as_ref()?;
        let credits = shm.ring_slots().map_or(self.header.shm_credits, |slots| slots.min(self.header.shm_credits));
        let held = shm.unreleased();
        (credits > 0 && held >= credits as usize).then_some((held, credits))
    }
}

impl Drop for BatchStream {
    fn drop(&mut self) {
        // Dropping the response stream resets the HTTP/2 stream: the daemon notices at once. The
        // task may be between counting a batch and queueing it on another thread, where an abort
        // does not reach: the hand-off lets that batch into the queue before this drains it, or
        // keeps it out and uncounted.
        let pushed = self.handoff.close();
        self.task.abort();
        if let Some(ring) = &self.rdma {
            // A receive on the blocking pool (which an abort does not reach) holds the ring until
            // it returns.
            ring.abandon();
        }
        if let Some(shm) = &self.shm {
            // Batches received but never handed out, and those still in flight, are released
            // now: only the ones the user holds keep their leases.
            while let Ok(item) = self.rx.try_recv() {
                if let Ok(b) = item
                    && b.is_leased()
                {
                    shm.release(b.index());
                }
            }
            shm.stream_end(pushed);
        }
    }
}

/// The IP address a TCP/TLS daemon address resolves to (its first); none for a Unix socket.
fn daemon_ip(addr: &Address) -> Result<Option<std::net::IpAddr>, ClientError> {
    use std::net::ToSocketAddrs;
    match addr {
        Address::Unix(_) => Ok(None),
        Address::Tcp(hp) | Address::Tls(hp) => {
            let mut found = hp.to_socket_addrs().map_err(|e| ClientError::Rdma(format!("cannot resolve {hp}: {e}")))?;
            Ok(found.next().map(|a| a.ip()))
        }
    }
}

/// The batch format a stream header announces (`StreamHeader.batch_format`): samples (inline,
/// shared-memory descriptors of TAR members, packed slots) or Arrow record batches (Parquet); a
/// format of a newer daemon is an error naming it, before anything is attached or parsed.
pub fn stream_format(batch_format: i32) -> Result<BatchFormat, ClientError> {
    BatchFormat::try_from(batch_format).map_err(|_| {
        ClientError::Protocol(format!(
            "the stream carries batch format {batch_format}, unknown to this client (is the daemon newer?)"
        ))
    })
}

/// Starts a stream and waits for its header (so request errors surface here).
pub async fn stream(client: &mut Client, req: StreamRequest) -> Result<BatchStream, ClientError> {
    stream_from(client, req, None).await
}

/// As [`stream`], for a client connected to `daemon`: an rdma ring is opened on the interface
/// that routes to the daemon's host (on another interface, the loopback first of all, the
/// daemon's writes could not reach it).
pub async fn stream_from(
    client: &mut Client,
    mut req: StreamRequest,
    daemon: Option<&Address>,
) -> Result<BatchStream, ClientError> {
    let first = req.start_batch;
    let open_ring = |provider: Option<String>| {
        let daemon = daemon.cloned();
        async move {
            tokio::task::spawn_blocking(move || {
                let toward = daemon.as_ref().map(daemon_ip).transpose()?.flatten();
                rdma::RdmaRing::open(first, toward, provider.as_deref())
            })
            .await
            .map_err(|e| ClientError::Rdma(format!("ring set-up task failed: {e}")))?
        }
    };
    let mut ring = None;
    if req.transport == shardstream_proto::Transport::Rdma as i32 {
        ring = Some(open_ring(None).await?);
    } else if req.transport == shardstream_proto::Transport::Auto as i32
        && matches!(daemon, Some(Address::Tcp(_) | Address::Tls(_)))
        && let Ok(st) = client.status(shardstream_proto::StatusRequest {}).await
    {
        // auto over TCP: rdma when the daemon serves it over a provider auto picks (hardware)
        // and this host opens that provider too; a ring that cannot be had leaves auto to the
        // daemon (shm or inline), and the stream's transport says which it took.
        let provider = st.into_inner().rdma_provider;
        if rdma::auto_picks(&provider)
            && let Ok(opened) = open_ring(Some(provider)).await
        {
            req.transport = shardstream_proto::Transport::Rdma as i32;
            ring = Some(opened);
        }
    }
    let ring = ring.map(|(ring, offer)| {
        req.rdma_offer = Some(offer);
        ring
    });
    let parts_allowed = req.max_batches_per_message;
    let mut inner = frames::stream_batches(client.channel.clone(), &req, shardstream_proto::MAX_MESSAGE_BYTES).await?;
    let header = match inner.message().await? {
        Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::Header(h)) }) => h,
        other => return Err(ClientError::Protocol(format!("expected a stream header, got {other:?}"))),
    };
    let arrow = stream_format(header.batch_format)? == BatchFormat::Arrow;
    // A stream without a batch (drop_last, more ranks than full batches) has nothing to map, and
    // the daemon may have ended it, and closed its session, before an attach would arrive.
    let shm = if header.transport == shardstream_proto::Transport::Shm as i32 && header.batches_in_stream > 0 {
        let socket = std::path::PathBuf::from(&header.shm_socket);
        let token = header.shm_token.clone();
        // Attaching is a few blocking syscalls on a local socket.
        Some(
            tokio::task::spawn_blocking(move || shm::ShmSession::attach(&socket, &token))
                .await
                .map_err(|e| ClientError::Shm(format!("attach task failed: {e}")))??,
        )
    } else {
        None
    };
    if let Some(r) = &ring {
        if header.transport != shardstream_proto::Transport::Rdma as i32 {
            return Err(ClientError::Protocol("asked for rdma, the daemon answered another transport".into()));
        }
        r.connect(&header.rdma_address, header.batches_in_stream)?;
    }
    let ring_in_task = ring.clone();
    let shm_in_task = shm.clone();
    let queue = if shm.is_some() { CLIENT_QUEUE_SHM } else { CLIENT_QUEUE };
    let (tx, rx) = mpsc::channel(queue);
    let expected = header.batches_in_stream;
    let handoff = std::sync::Arc::new(handoff::Handoff::default());
    let handoff_in_task = handoff.clone();
    let task = tokio::spawn(async move {
        let mut received = 0u64;
        let mut joiner = inline::Joiner::default();
        let mut arrow_joiner = arrow_join::ArrowJoiner::default();
        // Places in the queue reserved and not used yet.
        let mut places: Option<mpsc::PermitIterator<'_, _>> = None;
        loop {
            let item = match inner.message().await {
                // Batches must be of the format the header announced: an Arrow stream must never
                // reach code that reads TAR members, nor samples code that opens Arrow IPC.
                Ok(Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::ArrowBatch(_)) }))
                    if !arrow =>
                {
                    Err(ClientError::Protocol("an Arrow batch in a stream of samples".into()))
                }
                Ok(Some(shardstream_proto::StreamMessage {
                    kind:
                        Some(
                            stream_message::Kind::InlineBatch(_)
                            | stream_message::Kind::ShmBatch(_)
                            | stream_message::Kind::PackedBatch(_)
                            | stream_message::Kind::RdmaBatch(_),
                        ),
                })) if arrow => {
                    Err(ClientError::Protocol("a batch of samples in a stream of Arrow record batches".into()))
                }
                Ok(Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::InlineBatch(b)) })) => {
                    match joiner.push(b) {
                        Ok(Some(b)) => {
                            received += 1;
                            Ok(Batch::Inline(b))
                        }
                        // A part of a batch split over several messages: wait for the rest.
                        Ok(None) => continue,
                        Err(e) => Err(e),
                    }
                }
                Ok(Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::ShmBatch(b)) })) => {
                    received += 1;
                    Ok(Batch::Shm(b))
                }
                Ok(Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::PackedBatch(b)) })) => {
                    received += 1;
                    Ok(Batch::Packed(b))
                }
                Ok(Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::ArrowBatch(b)) })) => {
                    match arrow_joiner.push(b) {
                        // A part of a batch split over several messages: wait for the rest.
                        Ok(None) => continue,
                        Err(e) => Err(e),
                        Ok(Some(b)) => {
                            match (arrow_parts(&b, parts_allowed).map(|p| p.len() as u64), ring_in_task.clone()) {
                                (Err(e), _) => Err(e),
                                (Ok(batches), None) => {
                                    received += batches;
                                    let mut b = b;
                                    b.data = aligned_ipc(std::mem::take(&mut b.data));
                                    Ok(Batch::Arrow(b))
                                }
                                // Over rdma the IPC stream is in a slot of the ring: read in place.
                                (Ok(batches), Some(r)) => {
                                    received += batches;
                                    match tokio::task::spawn_blocking(move || r.receive_arrow(b, batches)).await {
                                        Ok(got) => got.map(Batch::Arrow),
                                        Err(e) => Err(ClientError::Rdma(format!("receive task failed: {e}"))),
                                    }
                                }
                            }
                        }
                    }
                }
                Ok(Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::RdmaBatch(b)) })) => {
                    received += 1;
                    match ring_in_task.clone() {
                        Some(r) => match tokio::task::spawn_blocking(move || r.receive(b)).await {
                            Ok(got) => got.map(Batch::Inline),
                            Err(e) => Err(ClientError::Rdma(format!("receive task failed: {e}"))),
                        },
                        None => Err(ClientError::Protocol("an rdma batch on a stream without a ring".into())),
                    }
                }
                Ok(Some(_)) => Err(ClientError::Protocol("unexpected message kind in batch stream".into())),
                // A stream that ends early must never look like the end of an epoch.
                Ok(None) if received < expected => Err(ClientError::Disconnected(format!(
                    "stream ended after {received} of {expected} batches (daemon stopped?)"
                ))),
                Ok(None) => return,
                Err(s) => Err(ClientError::from(s)),
            };
            let stop = item.is_err();
            let index = match &item {
                Ok(b) if b.is_leased() => Some(b.index()),
                _ => None,
            };
            // Reserve first: a batch is counted and queued in one step that must not wait.
            let permit = match places.as_mut().and_then(Iterator::next) {
                Some(p) => p,
                None => {
                    let Ok(mut more) = tx.reserve_many(refill(queue)).await else { return };
                    let Some(p) = more.next() else { return };
                    places = Some(more);
                    p
                }
            };
            let queued = handoff_in_task.pass(index, || {
                if index.is_some()
                    && let Some(s) = &shm_in_task
                {
                    s.received_leased();
                }
                permit.send(item);
            });
            if stop || !queued {
                return;
            }
        }
    });
    Ok(BatchStream { header, shm, rdma: ring, rx, task, handoff })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipc_stream_is_handed_on_aligned_with_its_bytes() {
        let whole = bytes::Bytes::from((0..=255u8).cycle().take(4096 + IPC_ALIGN).collect::<Vec<u8>>());
        let at = IPC_ALIGN - (whole.as_ptr() as usize) % IPC_ALIGN;
        for skew in [0, 1, 3, 8, 63] {
            let data = whole.slice(at + skew..at + skew + 4000);
            let out = aligned_ipc(data.clone());
            assert_eq!(out, data);
            assert_eq!(out.as_ptr() as usize % IPC_ALIGN, 0, "skew {skew}");
            // Already aligned: no copy.
            assert_eq!(out.as_ptr() == data.as_ptr(), skew == 0, "skew {skew}");
        }
    }

    #[test]
    fn transport_failures_are_disconnects_and_daemon_statuses_stay() {
        use tonic::{Code, Status};
        // What tonic makes of a connection that dies mid-stream: a status with the cause as source.
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let broken = Status::from_error(Box::new(reset));
        assert!(is_transport_failure(&broken));
        assert!(matches!(ClientError::from(broken), ClientError::Disconnected(_)));
        let pipe = Status::from_error(Box::new(std::io::Error::from(std::io::ErrorKind::BrokenPipe)));
        assert!(matches!(ClientError::from(pipe), ClientError::Disconnected(_)));
        // Statuses the daemon sent carry no source, whatever their code.
        for code in [Code::Unknown, Code::Unavailable, Code::Internal, Code::DataLoss, Code::InvalidArgument] {
            let s = Status::new(code, "from the daemon");
            assert!(!is_transport_failure(&s), "{code:?}");
            assert!(matches!(ClientError::from(s), ClientError::Status(_)), "{code:?}");
        }
    }

    #[test]
    fn arrow_parts_are_checked_before_a_batch_is_cut() {
        use shardstream_proto::ArrowBatch;
        let msg = |index, parts: &[(u64, u32)], rows: usize| ArrowBatch {
            batch_index: index,
            row_ids: (0..rows as u64).collect(),
            part_indices: parts.iter().map(|p| p.0).collect(),
            part_rows: parts.iter().map(|p| p.1).collect(),
            ..Default::default()
        };
        assert_eq!(arrow_parts(&msg(7, &[], 3), 0).unwrap(), vec![(7, 3)]);
        // A worker's batches are every num_workers-th of the rank's; the last may be short.
        let parts = [(4, 2), (6, 2), (8, 1)];
        assert_eq!(arrow_parts(&msg(4, &parts, 5), 4).unwrap(), parts.to_vec());
        let err = |m: &ArrowBatch, allowed| arrow_parts(m, allowed).unwrap_err().to_string();
        assert!(err(&msg(4, &parts, 5), 2).contains("more than the 2 asked for"));
        assert!(err(&msg(4, &parts, 5), 0).contains("more than the 1 asked for"));
        assert!(err(&msg(5, &parts, 5), 4).contains("first part"));
        assert!(err(&msg(4, &[(4, 2), (4, 3)], 5), 4).contains("do not increase"));
        assert!(err(&msg(4, &parts, 6), 4).contains("5 rows in all, but 6"));
        let mut uneven = msg(4, &parts, 5);
        uneven.part_rows.pop();
        assert!(err(&uneven, 4).contains("3 part indices but 2"));
    }

    #[test]
    fn stream_formats_are_known_or_named() {
        assert_eq!(stream_format(BatchFormat::Samples as i32).unwrap(), BatchFormat::Samples);
        assert_eq!(stream_format(BatchFormat::Arrow as i32).unwrap(), BatchFormat::Arrow);
        let newer = stream_format(7).unwrap_err().to_string();
        assert!(newer.contains("batch format 7"), "{newer}");
    }

    #[test]
    fn parses_addresses() {
        assert_eq!("unix:///run/s.sock".parse::<Address>().unwrap(), Address::Unix("/run/s.sock".into()));
        assert_eq!("/run/s.sock".parse::<Address>().unwrap(), Address::Unix("/run/s.sock".into()));
        assert_eq!("tcp://127.0.0.1:7000".parse::<Address>().unwrap(), Address::Tcp("127.0.0.1:7000".into()));
        assert_eq!("tls://node-3:7000".parse::<Address>().unwrap(), Address::Tls("node-3:7000".into()));
        assert_eq!(Address::Tls("node-3:7000".into()).to_string(), "tls://node-3:7000");
        for bad in ["", "unix://rel", "tcp://nohost", "tcp://:1", "tcp://h:99999", "http://x:1", "sock", "tls://h"] {
            assert!(bad.parse::<Address>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_token_never_goes_out_in_plaintext_beyond_loopback() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "abcdefghijklmnop-secret\n").unwrap();
        let creds = Credentials { token_file: Some(file), ..Default::default() };
        let e = creds.bearer(&"tcp://10.0.0.1:7000".parse().unwrap()).unwrap_err().to_string();
        assert!(e.contains("plaintext") && e.contains("tls://10.0.0.1:7000") && !e.contains("secret"), "{e}");
        let v = creds.bearer(&"tcp://127.0.0.1:7000".parse().unwrap()).unwrap().unwrap();
        assert_eq!(v.to_str().unwrap(), "Bearer abcdefghijklmnop-secret");
        assert!(!format!("{v:?}").contains("secret"), "the header is marked sensitive");
        assert!(creds.bearer(&"tls://10.0.0.1:7000".parse().unwrap()).unwrap().is_some());
        assert!(creds.bearer(&"unix:///run/s".parse().unwrap()).unwrap().is_none(), "Unix peers need no token");
        let e = Credentials::default().tls("h").unwrap_err().to_string();
        assert!(e.contains("SHARDSTREAM_TLS_CA"), "{e}");
    }
}
