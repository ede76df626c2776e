//! Client of the shardstream daemon, without Python: parse an address, connect over a Unix socket
//! or TCP, open datasets and stream batches. The Python package and the `shardstream status` CLI
//! are both built on it.
//!
//! A stream is drained by a background task into a small channel, so decoding the next batch
//! overlaps with the consumer's work on the current one.

use std::path::PathBuf;
use std::str::FromStr;

use hyper_util::rt::TokioIo;
use shardstream_proto::shardstream_client::ShardstreamClient;
use shardstream_proto::{DatasetInfo, OpenRequest, StreamHeader, StreamRequest, stream_message};
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint, Uri};

pub use shardstream_proto as proto;

pub mod rdma;
pub mod shm;

/// HTTP/2 flow-control windows. A batch of 256 x 20 KiB is 5 MiB; windows of several batches keep
/// the daemon sending while the client decodes (the 64 KiB default would stall every batch on
/// round trips).
pub const STREAM_WINDOW: u32 = 64 << 20;
pub const CONNECTION_WINDOW: u32 = 256 << 20;

/// Batches decoded ahead of the consumer.
const CLIENT_QUEUE: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid daemon address {0:?}: expected unix:///path/to/socket or tcp://host:port")]
    BadAddress(String),
    #[error("cannot connect to the shardstream daemon at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: tonic::transport::Error,
    },
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
            ClientError::Disconnected(format!("{:?}: {}", s.code(), s.message()))
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
    let mut source = std::error::Error::source(s);
    while let Some(e) = source {
        if e.is::<h2::Error>()
            || e.is::<hyper::Error>()
            || e.is::<std::io::Error>()
            || e.is::<tonic::transport::Error>()
        {
            return true;
        }
        source = e.source();
    }
    false
}

/// Where a daemon listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Unix(PathBuf),
    Tcp(String),
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
        if let Some(hp) = s.strip_prefix("tcp://") {
            let (host, port) = hp.rsplit_once(':').ok_or_else(bad)?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad());
            }
            return Ok(Address::Tcp(hp.to_owned()));
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
        }
    }
}

pub type Client = ShardstreamClient<Channel>;

/// Connects to a daemon (waits for the connection, so a missing daemon is an error here).
pub async fn connect(addr: &Address) -> Result<Client, ClientError> {
    let connect_err = |source| ClientError::Connect { addr: addr.to_string(), source };
    let channel = match addr {
        Address::Tcp(hp) => tuned(Endpoint::from_shared(format!("http://{hp}")).map_err(connect_err)?)
            .connect()
            .await
            .map_err(connect_err)?,
        Address::Unix(path) => {
            let path = path.clone();
            // The URI is required by the API but unused: the connector dials the socket.
            tuned(Endpoint::from_static("http://localhost"))
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
                }))
                .await
                .map_err(connect_err)?
        }
    };
    Ok(ShardstreamClient::new(channel)
        .max_decoding_message_size(shardstream_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(shardstream_proto::MAX_MESSAGE_BYTES))
}

fn tuned(e: Endpoint) -> Endpoint {
    e.initial_stream_window_size(STREAM_WINDOW).initial_connection_window_size(CONNECTION_WINDOW).tcp_nodelay(true)
}

/// Opens a dataset. `cache`: how its shards are read ("direct", "copy", or "" for the daemon's
/// choice: through the node cache for S3, in place for file systems).
pub async fn open(client: &mut Client, url: &str, cache: &str) -> Result<DatasetInfo, ClientError> {
    let req = OpenRequest {
        url: url.to_owned(),
        protocol_version: shardstream_proto::PROTOCOL_VERSION,
        cache: cache.to_owned(),
    };
    Ok(client.open_dataset(req).await?.into_inner())
}

/// A received batch: bytes inline, descriptors into shards mapped through `shm`, or a slot of the
/// stream's ring (packed mode).
#[derive(Debug)]
pub enum Batch {
    Inline(shardstream_proto::InlineBatch),
    Shm(shardstream_proto::ShmBatch),
    Packed(shardstream_proto::PackedBatch),
}

impl Batch {
    /// Index of the batch in the rank's batch order.
    pub fn index(&self) -> u64 {
        match self {
            Batch::Inline(b) => b.batch_index,
            Batch::Shm(b) => b.batch_index,
            Batch::Packed(b) => b.batch_index,
        }
    }

    /// True when the batch holds a lease or slot that must be released (shared memory).
    pub fn is_leased(&self) -> bool {
        !matches!(self, Batch::Inline(_))
    }
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
    /// Index + 1 of the last batch put into `rx` (0: none yet).
    pushed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl BatchStream {
    /// Next batch; `None` at the end of the stream.
    pub async fn next(&mut self) -> Option<Result<Batch, ClientError>> {
        self.rx.recv().await
    }
}

impl Drop for BatchStream {
    fn drop(&mut self) {
        // Dropping the response stream resets the HTTP/2 stream: the daemon notices at once.
        self.task.abort();
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
            shm.stream_end(self.pushed.load(std::sync::atomic::Ordering::Acquire));
        }
    }
}

/// Starts a stream and waits for its header (so request errors surface here).
pub async fn stream(client: &mut Client, mut req: StreamRequest) -> Result<BatchStream, ClientError> {
    let ring = if req.transport == shardstream_proto::Transport::Rdma as i32 {
        let first = req.start_batch;
        let (ring, offer) = tokio::task::spawn_blocking(move || rdma::RdmaRing::open(first))
            .await
            .map_err(|e| ClientError::Rdma(format!("ring set-up task failed: {e}")))??;
        req.rdma_offer = Some(offer);
        Some(ring)
    } else {
        None
    };
    let mut inner = client.stream_batches(req).await?.into_inner();
    let header = match inner.message().await? {
        Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::Header(h)) }) => h,
        other => return Err(ClientError::Protocol(format!("expected a stream header, got {other:?}"))),
    };
    let shm = if header.transport == shardstream_proto::Transport::Shm as i32 {
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
        r.connect(&header.rdma_address)?;
    }
    let ring_in_task = ring.clone();
    let (tx, rx) = mpsc::channel(CLIENT_QUEUE);
    let expected = header.batches_in_stream;
    let pushed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let pushed_in_task = pushed.clone();
    let task = tokio::spawn(async move {
        let mut received = 0u64;
        loop {
            let item = match inner.message().await {
                Ok(Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::InlineBatch(b)) })) => {
                    received += 1;
                    Ok(Batch::Inline(b))
                }
                Ok(Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::ShmBatch(b)) })) => {
                    received += 1;
                    Ok(Batch::Shm(b))
                }
                Ok(Some(shardstream_proto::StreamMessage { kind: Some(stream_message::Kind::PackedBatch(b)) })) => {
                    received += 1;
                    Ok(Batch::Packed(b))
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
            // Reserve first, so that "pushed" is updated before the batch can be taken.
            let Ok(permit) = tx.reserve().await else { return };
            if let Some(i) = index {
                pushed_in_task.store(i + 1, std::sync::atomic::Ordering::Release);
            }
            permit.send(item);
            if stop {
                return;
            }
        }
    });
    Ok(BatchStream { header, shm, rdma: ring, rx, task, pushed })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn parses_addresses() {
        assert_eq!("unix:///run/s.sock".parse::<Address>().unwrap(), Address::Unix("/run/s.sock".into()));
        assert_eq!("/run/s.sock".parse::<Address>().unwrap(), Address::Unix("/run/s.sock".into()));
        assert_eq!("tcp://127.0.0.1:7000".parse::<Address>().unwrap(), Address::Tcp("127.0.0.1:7000".into()));
        for bad in ["", "unix://rel", "tcp://nohost", "tcp://:1", "tcp://h:99999", "http://x:1", "sock"] {
            assert!(bad.parse::<Address>().is_err(), "{bad}");
        }
    }
}
