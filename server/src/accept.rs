//! Accepting a listener's connections (TCP or the Unix socket) for the gRPC server: each gets
//! `--tcp-timeout` from its accept to finish the TLS handshake and send the HTTP/2 preface, or it
//! is closed.
//!
//! Why the daemon does this and not tonic (0.14): tonic's `Server::tls_config` runs the TLS accept
//! with no deadline, and hyper's HTTP/2 server waits for a client's preface forever, so a
//! connection that never says anything (no ClientHello; on an `--insecure` listener or the Unix
//! socket, no preface) was held for good. A few hundred of them, from a peer with no credentials
//! at all, used up the daemon's open-file limit, and real clients then failed or hung. Worse, once
//! the limit was reached, tonic's accept loop retried at once without end (a core spinning) and
//! said so at trace level only; and it logged a refused handshake (an expired client certificate,
//! none at all for a `--tls-client-ca` daemon) at debug level: at the daemon's level, nothing. The
//! Unix socket admits only its owner (or `--socket-group`), but one of them connecting in a loop
//! (a buggy launcher) did the same to every other job on the node.
//!
//! So here, for plaintext, TLS and the Unix socket alike:
//! - every connection has one deadline, its accept plus `--tcp-timeout`, by which its TLS
//!   handshake must be done ([`tls`]: each in a task of its own, so a slow one delays no other)
//!   and its first 24 bytes, the HTTP/2 client preface, read ([`PrefaceDeadline`]). From then on
//!   HTTP/2 keepalive (set in [`crate::daemon`]) watches a TCP one, and a stop ends one whose
//!   client answers nothing ([`STOP_GRACE`]);
//! - at most [`max_handshaking`] connections may be in that phase at once: more are closed at
//!   once;
//! - an accept error pauses accepting for [`ACCEPT_PAUSE`] instead of retrying at once;
//! - each of these, and every failed or timed-out TLS handshake, is logged as a warning at most
//!   once every [`WARN_EVERY`] per kind, with the count left out: a peer makes
//!   them as fast as it opens connections.
//!
//! The TLS configuration is the one tonic built ([`crate::remote`]), and the streams handed to
//! tonic are `tokio_rustls::server::TlsStream<TcpStream>` or `UnixStream` (inside
//! [`PrefaceDeadline`], which passes their connection info on), so `Request::peer_certs`,
//! `remote_addr` and the Unix peer's credentials work as before.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::transport::server::Connected;

/// Connections at most between their accept and their HTTP/2 preface (TLS handshake included);
/// more are closed as soon as they are accepted. Far above what real clients need (a trainer
/// opens a few connections per worker, and each leaves this phase within a round trip or two),
/// and below a daemon's open-file limit (raised to the hard one, see [`crate::nofile`]): a flood
/// of idle connections is refused before it can take the descriptors the daemon's streams need.
/// Each is closed by its deadline anyway; this bounds how many the flood holds meanwhile.
pub const MAX_HANDSHAKING: usize = 1024;

/// The cap on connections in their handshake for this process: [`MAX_HANDSHAKING`], or a quarter
/// of the open-file limit when that is lower (a hard limit of 1,024 is common), so that a flood
/// leaves most descriptors to the streams; never below 16.
pub fn max_handshaking() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
    let quarter = limit.map_or(usize::MAX, |n| usize::try_from(n / 4).unwrap_or(usize::MAX));
    quarter.clamp(16, MAX_HANDSHAKING)
}

/// The HTTP/2 client preface (`PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`): what a client must send first.
const PREFACE_LEN: usize = 24;

/// How long accepting pauses after an accept error that is not one connection's own: out of
/// descriptors, retrying at once would only spin a core until some are closed.
pub const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// At most one warning of each kind in this long.
pub const WARN_EVERY: Duration = Duration::from_secs(10);

/// Connections ready but not yet taken by the server (it takes them as fast as they come; while
/// it does not, accepting waits, and new connections wait in the kernel's backlog).
const READY_QUEUE: usize = 64;

/// The connections of a listener, ready for `serve_with_incoming`. Never yields an error: each is
/// dealt with here (tonic ends serving on an accept error it does not know as transient).
pub type Incoming<IO> = ReceiverStream<io::Result<PrefaceDeadline<IO>>>;

/// Who is at the other end of a connection, for the warnings about it.
#[derive(Debug, Clone, Copy)]
pub enum Peer {
    Tcp(SocketAddr),
    /// A Unix-socket client's credentials (`None`: the kernel gave none).
    Unix {
        uid: Option<u32>,
        pid: Option<i32>,
    },
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Tcp(addr) => addr.fmt(f),
            Peer::Unix { uid, pid } => {
                f.write_str("unix socket client")?;
                if let Some(uid) = uid {
                    write!(f, " uid {uid}")?;
                }
                if let Some(pid) = pid {
                    write!(f, " pid {pid}")?;
                }
                Ok(())
            }
        }
    }
}

/// A listening socket whose connections [`start`] accepts.
pub trait Listen: Send + 'static {
    type Stream: Send + 'static;
    /// The next connection, ready to be handed over (or handshaken), and its peer.
    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, Peer)>> + Send;
}

impl Listen for TcpListener {
    type Stream = TcpStream;

    async fn accept(&self) -> io::Result<(TcpStream, Peer)> {
        let (stream, peer) = TcpListener::accept(self).await?;
        // Nagle off: `serve_with_incoming` takes the sockets as they are (tonic's `tcp_nodelay`
        // applies only to listeners it binds), and with Nagle on the tail of every batch message
        // waits for the client's ACK of the data before it. A failure here is the connection's
        // own (gone as it was accepted).
        stream.set_nodelay(true).map_err(|e| io::Error::new(io::ErrorKind::ConnectionAborted, e))?;
        Ok((stream, Peer::Tcp(peer)))
    }
}

impl Listen for UnixListener {
    type Stream = UnixStream;

    async fn accept(&self) -> io::Result<(UnixStream, Peer)> {
        let (stream, _) = UnixListener::accept(self).await?;
        let cred = stream.peer_cred().ok();
        let peer = Peer::Unix { uid: cred.map(|c| c.uid()), pid: cred.and_then(|c| c.pid()) };
        Ok((stream, peer))
    }
}

/// What bounds a connection before its preface: `--tcp-timeout` from its accept, and the daemon's
/// shutdown (hyper's graceful shutdown waits for a connection that never sent its preface, which
/// held every stop for the whole drain timeout).
#[derive(Clone)]
pub struct Limits {
    pub timeout: Duration,
    pub shutdown: CancellationToken,
}

/// A plaintext (`--insecure`) listener's connections, handed over as soon as they are accepted
/// (so none waits for another); [`PrefaceDeadline`] bounds their wait for the preface.
pub fn plaintext(listener: TcpListener, limits: Limits) -> Incoming<TcpStream> {
    start(listener, limits, max_handshaking(), |stream| std::future::ready(Ok(stream)))
}

/// The Unix socket's connections, as [`plaintext`]'s.
pub fn unix(listener: UnixListener, limits: Limits) -> Incoming<UnixStream> {
    start(listener, limits, max_handshaking(), |stream| std::future::ready(Ok(stream)))
}

/// A TLS listener's connections, each handed over once its handshake with `config` is done.
pub fn tls(listener: TcpListener, config: Arc<ServerConfig>, limits: Limits) -> Incoming<TlsStream<TcpStream>> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    start(listener, limits, max_handshaking(), move |stream| acceptor.accept(stream))
}

/// Spawns the accept loop; `handshake` is what a connection goes through before it is served
/// (only a TLS one can fail or take time).
fn start<L, IO, F, Fut>(listener: L, limits: Limits, max: usize, handshake: F) -> Incoming<IO>
where
    L: Listen,
    IO: Send + 'static,
    F: Fn(L::Stream) -> Fut + Send + 'static,
    Fut: Future<Output = io::Result<IO>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(READY_QUEUE);
    tokio::spawn(accept_loop(listener, Shared::new(limits, max), handshake, tx));
    ReceiverStream::new(rx)
}

/// What the accept loop, its handshake tasks and the connections' deadlines share.
struct Shared {
    timeout: Duration,
    shutdown: CancellationToken,
    /// [`max_handshaking`] (smaller in tests).
    max: usize,
    /// Connections accepted whose preface has not been read yet (see [`Handshaking`]).
    handshaking: AtomicUsize,
    /// Apart from the timeouts: a flood of idle connections must not hide a refused certificate.
    handshake_failed_warn: Throttle,
    handshake_timeout_warn: Throttle,
    preface_warn: Throttle,
}

impl Shared {
    fn new(limits: Limits, max: usize) -> Arc<Self> {
        Arc::new(Shared {
            timeout: limits.timeout,
            shutdown: limits.shutdown,
            max,
            handshaking: AtomicUsize::new(0),
            handshake_failed_warn: Throttle::default(),
            handshake_timeout_warn: Throttle::default(),
            preface_warn: Throttle::default(),
        })
    }

    /// Counts one more connection in its handshake, unless `max` already are.
    fn enter(self: &Arc<Self>) -> Option<Handshaking> {
        // Only the accept loop adds, so the load and the add cannot race past `max`.
        if self.handshaking.load(Ordering::Relaxed) >= self.max {
            return None;
        }
        self.handshaking.fetch_add(1, Ordering::Relaxed);
        Some(Handshaking(self.clone()))
    }
}

/// One connection counted in [`Shared::handshaking`], until its preface is read or it is closed.
struct Handshaking(Arc<Shared>);

impl Drop for Handshaking {
    fn drop(&mut self) {
        self.0.handshaking.fetch_sub(1, Ordering::Relaxed);
    }
}

/// `tracing::warn!` when `$throttle` lets it through, with `suppressed`: how many it left out since
/// the last (absent when none). For warnings a peer can cause at will: a line each would let it
/// fill the daemon's log (and disk) as fast as it can send.
macro_rules! throttled_warn {
    ($throttle:expr, $($arg:tt)+) => {
        if let Some(suppressed) = $throttle.admit() {
            let suppressed = (suppressed > 0).then_some(suppressed);
            tracing::warn!(suppressed, $($arg)+);
        }
    };
}
pub(crate) use throttled_warn;

async fn accept_loop<L, IO, F, Fut>(
    listener: L,
    shared: Arc<Shared>,
    handshake: F,
    tx: mpsc::Sender<io::Result<PrefaceDeadline<IO>>>,
) where
    L: Listen,
    IO: Send + 'static,
    F: Fn(L::Stream) -> Fut + Send + 'static,
    Fut: Future<Output = io::Result<IO>> + Send + 'static,
{
    // Dropped with the loop: handshakes still running end with it.
    let mut handshakes = JoinSet::new();
    let (accept_warn, full_warn) = (Throttle::default(), Throttle::default());
    loop {
        let accepted = tokio::select! {
            // The server stopped taking connections (shutdown): returning closes the listener,
            // so new clients are refused instead of left waiting in the backlog.
            () = tx.closed() => return,
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                let failure = AcceptFailure::of(&e);
                match failure {
                    AcceptFailure::Connection => {
                        tracing::debug!(error = %e, "a connection failed before it was accepted")
                    }
                    AcceptFailure::OutOfFiles => throttled_warn!(
                        accept_warn,
                        error = %e,
                        "cannot accept connections: the daemon's open-file limit is reached; retrying every {} ms \
                         (raise its limit: LimitNOFILE in its systemd unit, `ulimit -n`)",
                        ACCEPT_PAUSE.as_millis()
                    ),
                    AcceptFailure::Other => throttled_warn!(
                        accept_warn,
                        error = %e,
                        "cannot accept connections; retrying every {} ms",
                        ACCEPT_PAUSE.as_millis()
                    ),
                }
                if failure != AcceptFailure::Connection {
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
                continue;
            }
        };
        let Some(counted) = shared.enter() else {
            throttled_warn!(
                full_warn,
                %peer,
                "{} connections are already waiting for their TLS handshake or HTTP/2 preface: closing new \
                 ones at once until fewer are (idle connections from some peer?)",
                shared.max
            );
            continue;
        };
        let deadline = Instant::now() + shared.timeout;
        let handshake = handshake(stream);
        let tx = tx.clone();
        handshakes.spawn(async move {
            let shared = counted.0.clone();
            match tokio::time::timeout_at(deadline, handshake).await {
                Ok(Ok(io)) => {
                    // Fails only when the server has stopped taking connections: this one closes.
                    let _ = tx.send(Ok(PrefaceDeadline::new(io, deadline, peer, counted))).await;
                }
                // The peer left mid-handshake: a TCP health check connects and closes, which is
                // no failure worth a warning.
                Ok(Err(e)) if matches!(e.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake: the peer closed the connection");
                }
                Ok(Err(e)) => throttled_warn!(
                    shared.handshake_failed_warn,
                    %peer,
                    error = %e,
                    "TLS handshake failed: connection closed"
                ),
                Err(_) => throttled_warn!(
                    shared.handshake_timeout_warn,
                    %peer,
                    "TLS handshake not done {} s after connecting (--tcp-timeout): connection closed",
                    shared.timeout.as_secs_f64()
                ),
            }
        });
    }
}

/// Kinds of accept errors, by what the loop does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AcceptFailure {
    /// One connection's own (reset before it was accepted, or a network error accept(2) passes
    /// on, which its man page says to treat like EAGAIN; gone as it was set up): accept the next
    /// at once, quietly.
    Connection,
    /// Out of descriptors (EMFILE for the process, ENFILE for the system): warn and pause.
    OutOfFiles,
    /// Anything else (out of socket buffers or memory, ...): warn and pause; never stop serving.
    Other,
}

impl AcceptFailure {
    fn of(e: &io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::EMFILE | libc::ENFILE) => Self::OutOfFiles,
            Some(
                libc::ECONNABORTED
                | libc::ECONNRESET
                | libc::EINTR
                | libc::EAGAIN
                | libc::ETIMEDOUT
                | libc::EPROTO
                | libc::EPERM
                | libc::ENETDOWN
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::ENONET
                | libc::EHOSTUNREACH
                | libc::EOPNOTSUPP
                | libc::ENETUNREACH,
            ) => Self::Connection,
            None if e.kind() == io::ErrorKind::ConnectionAborted => Self::Connection,
            _ => Self::Other,
        }
    }
}

/// Lets a kind of warning through at most once every [`WARN_EVERY`], counting those it holds back.
#[derive(Default)]
pub(crate) struct Throttle(Mutex<ThrottleState>);

#[derive(Default)]
struct ThrottleState {
    last: Option<std::time::Instant>,
    suppressed: u64,
}

impl Throttle {
    /// `Some(n)`: log this one (n were held back since the last); `None`: hold it back.
    pub(crate) fn admit(&self) -> Option<u64> {
        // A panic elsewhere cannot leave the state inconsistent: two plain fields.
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let now = std::time::Instant::now();
        if state.last.is_some_and(|last| now.duration_since(last) < WARN_EVERY) {
            state.suppressed += 1;
            return None;
        }
        state.last = Some(now);
        Some(std::mem::take(&mut state.suppressed))
    }
}

/// A connection whose reads fail with `TimedOut` once its deadline passes before the first
/// 24 bytes (the HTTP/2 client preface) were read; after them, it is `IO` as it is.
/// hyper then ends the connection, which closes it. Its connection info is `IO`'s, so tonic puts
/// the same request extensions in (`TlsConnectInfo<TcpConnectInfo>` for TLS: the peer's
/// certificates and address).
pub struct PrefaceDeadline<IO> {
    inner: IO,
    /// `None` once the preface is read.
    waiting: Option<Waiting>,
    /// After the preface: the connection's end when the daemon stops.
    stop: Stop,
}

/// How long a connection's client has to answer the stop. hyper's graceful shutdown sends each
/// connection a GOAWAY and a PING and waits for the answer: a client that is stopped (Ctrl-Z) or
/// gone held every stop for the whole drain timeout. A live client's HTTP/2 layer answers at
/// once, even while its trainer reads nothing (a long step with its queue full), and such a
/// connection is left to end with its streams, within the drain timeout: cut when it was merely
/// quiet, the trainer saw a broken connection instead of its queued batches and "daemon is
/// shutting down". Counted from the stop, or from the last write that moved bytes after it (a
/// client on a slow link may take longer to get to the PING); checked where the connection waits,
/// reading or writing (a client frozen mid-stream leaves the daemon's writes blocked, and hyper
/// reads nothing until they go out).
pub const STOP_GRACE: Duration = Duration::from_secs(1);

struct Stop {
    token: CancellationToken,
    /// Wakes the reader when the stop begins.
    stopping: Pin<Box<WaitForCancellationFutureOwned>>,
    /// When this connection first saw the stop.
    stopped_at: Option<Instant>,
    /// Whether the client has sent a byte since the stop began.
    answered: bool,
    /// The last write after the stop that moved bytes.
    wrote_at: Option<Instant>,
    /// Wakes the connection's task when its [`STOP_GRACE`] runs out.
    grace: Option<Pin<Box<Sleep>>>,
}

impl Stop {
    /// Whether the daemon is stopping (when not yet, the reader is woken when it does).
    fn stopped(&mut self, cx: &mut Context<'_>) -> bool {
        let stopped = self.token.is_cancelled() || self.stopping.as_mut().poll(cx).is_ready();
        if stopped && self.stopped_at.is_none() {
            self.stopped_at = Some(Instant::now());
        }
        stopped
    }

    /// Notes that the client sent bytes.
    fn heard(&mut self) {
        if self.stopped_at.is_some() || self.token.is_cancelled() {
            self.answered = true;
        }
    }

    /// Notes a write's outcome.
    fn wrote<T>(&mut self, written: &Poll<io::Result<T>>, moved: impl FnOnce(&T) -> bool) {
        if let Poll::Ready(Ok(n)) = written
            && moved(n)
            && (self.stopped_at.is_some() || self.token.is_cancelled())
        {
            self.wrote_at = Some(Instant::now());
        }
    }

    /// Whether the connection is to end now: the daemon stopped, the client has sent nothing since,
    /// and [`STOP_GRACE`] has passed since the stop and since the last write that moved bytes (when
    /// not yet, the task is woken when it will have).
    fn unanswered_past_grace(&mut self, cx: &mut Context<'_>) -> bool {
        if self.answered || !self.stopped(cx) {
            return false;
        }
        let Some(at) = self.stopped_at else { return false };
        let until = self.wrote_at.map_or(at, |w| w.max(at)) + STOP_GRACE;
        if Instant::now() >= until {
            return true;
        }
        let grace = self.grace.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
        if grace.deadline() != until {
            grace.as_mut().reset(until);
        }
        grace.as_mut().poll(cx).is_ready()
    }

    /// `polled`, or the connection's end when it is still waiting past the grace.
    fn or_cut<T>(&mut self, polled: Poll<io::Result<T>>, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        match polled {
            Poll::Pending if self.unanswered_past_grace(cx) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the daemon is stopping, and the client has not answered since",
            ))),
            polled => polled,
        }
    }
}

struct Waiting {
    deadline: Pin<Box<Sleep>>,
    read: usize,
    peer: Peer,
    /// Released with the preface (or the connection).
    counted: Handshaking,
}

impl<IO> PrefaceDeadline<IO> {
    fn new(inner: IO, deadline: Instant, peer: Peer, counted: Handshaking) -> Self {
        let deadline = Box::pin(tokio::time::sleep_until(deadline));
        let token = counted.0.shutdown.clone();
        let stop = Stop {
            stopping: Box::pin(token.clone().cancelled_owned()),
            token,
            stopped_at: None,
            answered: false,
            wrote_at: None,
            grace: None,
        };
        Self { inner, waiting: Some(Waiting { deadline, read: 0, peer, counted }), stop }
    }
}

impl<IO: Connected> Connected for PrefaceDeadline<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for PrefaceDeadline<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.stop.heard();
        }
        let Some(waiting) = &mut this.waiting else {
            return this.stop.or_cut(polled, cx);
        };
        match polled {
            Poll::Ready(Ok(())) => {
                waiting.read += buf.filled().len() - before;
                if waiting.read >= PREFACE_LEN {
                    this.waiting = None;
                }
                Poll::Ready(Ok(()))
            }
            // Bytes that came are taken even at the deadline; only a wait past it fails.
            Poll::Pending if this.stop.stopped(cx) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the daemon is shutting down, and this connection has not sent the HTTP/2 preface",
            ))),
            Poll::Pending => match waiting.deadline.as_mut().poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(()) => {
                    let shared = &waiting.counted.0;
                    throttled_warn!(
                        shared.preface_warn,
                        peer = %waiting.peer,
                        "no HTTP/2 request {} s after connecting (--tcp-timeout): connection closed",
                        shared.timeout.as_secs_f64()
                    );
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no HTTP/2 preface within --tcp-timeout of connecting",
                    )))
                }
            },
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for PrefaceDeadline<IO> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.stop.wrote(&polled, |n| *n > 0);
        this.stop.or_cut(polled, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.stop.wrote(&polled, |n| *n > 0);
        this.stop.or_cut(polled, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_flush(cx);
        this.stop.or_cut(polled, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_stream::StreamExt;

    use super::*;

    const PREFACE: &[u8; PREFACE_LEN] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn peer() -> Peer {
        Peer::Tcp(SocketAddr::from(([127, 0, 0, 1], 1)))
    }

    /// Short real deadlines (tokio's paused clock needs its `test-util` feature, not built here).
    const DEADLINE: Duration = Duration::from_millis(200);

    fn limits(timeout: Duration) -> Limits {
        Limits { timeout, shutdown: CancellationToken::new() }
    }

    /// A connection that has said its preface, and its client's end.
    async fn spoken(s: &Arc<Shared>) -> (tokio::io::DuplexStream, PrefaceDeadline<tokio::io::DuplexStream>) {
        let (mut client, server) = tokio::io::duplex(64);
        let counted = s.enter().unwrap();
        let mut conn = PrefaceDeadline::new(server, Instant::now() + s.timeout, peer(), counted);
        client.write_all(PREFACE).await.unwrap();
        conn.read_exact(&mut [0u8; PREFACE_LEN]).await.unwrap();
        (client, conn)
    }

    #[tokio::test]
    async fn a_quiet_connection_ends_a_grace_after_the_daemon_stops() {
        let s = Shared::new(limits(Duration::from_secs(60)), 8);
        let (_client, mut conn) = spoken(&s).await;
        s.shutdown.cancel();
        let started = Instant::now();
        let err = conn.read(&mut [0u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        let took = started.elapsed();
        assert!(took >= STOP_GRACE / 2 && took < 5 * STOP_GRACE, "{took:?}");
    }

    #[tokio::test]
    async fn a_connection_quiet_before_the_stop_gets_its_grace_from_the_stop() {
        let s = Shared::new(limits(Duration::from_secs(60)), 8);
        let (_client, mut conn) = spoken(&s).await;
        tokio::time::sleep(STOP_GRACE + DEADLINE).await; // a stream waiting, nothing moving
        let read = tokio::spawn(async move { conn.read(&mut [0u8; 64]).await });
        tokio::time::sleep(DEADLINE).await;
        let stopped = Instant::now();
        s.shutdown.cancel();
        let err = read.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        assert!(stopped.elapsed() >= STOP_GRACE / 2, "aborted {:?} after the stop", stopped.elapsed());
    }

    #[tokio::test]
    async fn a_client_frozen_with_the_daemons_writes_blocked_is_cut_at_the_grace() {
        let s = Shared::new(limits(Duration::from_secs(60)), 8);
        let (_client, mut conn) = spoken(&s).await;
        conn.write_all(&[0u8; 64]).await.unwrap(); // the pipe is full: the client reads nothing
        s.shutdown.cancel();
        let stopped = Instant::now();
        let written = tokio::time::timeout(5 * STOP_GRACE, conn.write_all(b"GOAWAY, PING")).await;
        let err = written.expect("still blocked past the grace").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        assert!(stopped.elapsed() >= STOP_GRACE / 2, "cut {:?} after the stop", stopped.elapsed());
    }

    #[tokio::test]
    async fn a_client_that_answers_the_stop_is_left_to_the_drain() {
        let s = Shared::new(limits(Duration::from_secs(60)), 8);
        let (mut client, mut conn) = spoken(&s).await;
        s.shutdown.cancel();
        let read = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            let n = conn.read(&mut buf).await;
            (tokio::time::timeout(3 * STOP_GRACE, conn.read(&mut buf)).await, n)
        });
        client.write_all(b"ping ack").await.unwrap(); // its HTTP/2 layer answers the GOAWAY's PING
        let (later, first) = read.await.unwrap();
        assert_eq!(first.unwrap(), 8);
        assert!(later.is_err(), "cut although its client answered: {later:?}");
    }

    #[tokio::test]
    async fn a_connection_without_its_preface_ends_when_the_daemon_stops() {
        let s = Shared::new(limits(Duration::from_secs(60)), 8);
        let (_client, server) = tokio::io::duplex(64);
        let counted = s.enter().unwrap();
        let mut conn = PrefaceDeadline::new(server, Instant::now() + s.timeout, peer(), counted);
        let stop = s.shutdown.clone();
        let started = Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(DEADLINE).await;
            stop.cancel();
        });
        let err = conn.read(&mut [0u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        assert!(started.elapsed() < 10 * DEADLINE, "ended at the stop, not at --tcp-timeout: {:?}", started.elapsed());
    }

    #[tokio::test]
    async fn a_connection_silent_past_its_deadline_fails_its_read() {
        let s = Shared::new(limits(DEADLINE), 8);
        let (_client, server) = tokio::io::duplex(64);
        let counted = s.enter().unwrap();
        let started = Instant::now();
        let mut conn = PrefaceDeadline::new(server, started + s.timeout, peer(), counted);
        let err = conn.read(&mut [0u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= DEADLINE && started.elapsed() < 10 * DEADLINE, "{:?}", started.elapsed());
        drop(conn);
        assert_eq!(s.handshaking.load(Ordering::Relaxed), 0, "a closed connection is no longer counted");
    }

    #[tokio::test]
    async fn a_preface_in_pieces_in_time_lifts_the_deadline() {
        let s = Shared::new(limits(DEADLINE), 8);
        let (mut client, server) = tokio::io::duplex(64);
        let counted = s.enter().unwrap();
        let mut conn = PrefaceDeadline::new(server, Instant::now() + s.timeout, peer(), counted);
        let mut buf = [0u8; 64];
        for piece in PREFACE.chunks(10) {
            client.write_all(piece).await.unwrap();
            assert_eq!(conn.read(&mut buf).await.unwrap(), piece.len());
        }
        assert_eq!(s.handshaking.load(Ordering::Relaxed), 0, "counted only until the preface");
        // Past the deadline, an idle connection is HTTP/2's to watch (keepalive), not ours.
        tokio::time::sleep(2 * DEADLINE).await;
        client.write_all(b"x").await.unwrap();
        assert_eq!(conn.read(&mut buf).await.unwrap(), 1);
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_are_closed_and_idle_ones_time_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = start(listener, limits(Duration::from_secs(1)), 2, |s| std::future::ready(Ok(s)));
        let mut idle = Vec::new();
        for _ in 0..2 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            let mut conn = incoming.next().await.unwrap().unwrap();
            // What the server would do: wait for the preface, which never comes.
            tokio::spawn(async move { conn.read(&mut [0u8; 64]).await });
        }
        // The third is closed at once: it reads end-of-stream well before any deadline.
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        let n = tokio::time::timeout(Duration::from_millis(500), third.read(&mut [0u8; 8])).await;
        assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "{n:?}");
        // Once the idle ones time out (their reads fail and the server drops them), there is room.
        for mut c in idle {
            let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut [0u8; 8])).await;
            assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "{n:?}");
        }
        let mut fourth = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut conn = incoming.next().await.unwrap().unwrap();
        fourth.write_all(PREFACE).await.unwrap();
        let mut buf = [0u8; PREFACE_LEN];
        conn.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, PREFACE);
    }

    #[tokio::test]
    async fn unix_socket_connections_have_the_same_cap_and_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sock");
        let listener = UnixListener::bind(&path).unwrap();
        let mut incoming = start(listener, limits(DEADLINE), 1, |s| std::future::ready(Ok(s)));
        let mut idle = UnixStream::connect(&path).await.unwrap();
        let mut conn = incoming.next().await.unwrap().unwrap();
        let peer = conn.waiting.as_ref().unwrap().peer.to_string();
        assert!(peer.contains(&format!("pid {}", std::process::id())), "{peer}");
        // The credentials tonic hands the authenticator pass through.
        assert!(conn.connect_info().peer_cred.is_some());
        // Checked before anything reads `conn`: unread, it stays counted whatever the machine's load.
        let mut second = UnixStream::connect(&path).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), second.read(&mut [0u8; 8])).await;
        assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "beyond the cap: closed at once, {n:?}");
        let err = conn.read(&mut [0u8; 64]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "no preface within the deadline");
        drop(conn); // as the server does with a connection whose read failed
        let n = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut [0u8; 8])).await;
        assert!(matches!(n, Ok(Ok(_)) | Ok(Err(_))), "{n:?}");
    }

    #[test]
    fn the_cap_leaves_three_quarters_of_the_open_files_to_the_streams() {
        let cap = max_handshaking();
        assert!((16..=MAX_HANDSHAKING).contains(&cap), "{cap}");
        if let Some(limit) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current {
            assert!(cap as u64 <= (limit / 4).max(16), "cap {cap} under an open-file limit of {limit}");
        }
    }

    #[test]
    fn out_of_descriptors_pauses_and_a_lost_connection_does_not() {
        let os = io::Error::from_raw_os_error;
        assert_eq!(AcceptFailure::of(&os(libc::EMFILE)), AcceptFailure::OutOfFiles);
        assert_eq!(AcceptFailure::of(&os(libc::ENFILE)), AcceptFailure::OutOfFiles);
        assert_eq!(AcceptFailure::of(&os(libc::ECONNABORTED)), AcceptFailure::Connection);
        assert_eq!(AcceptFailure::of(&os(libc::ENOBUFS)), AcceptFailure::Other);
        let gone = io::Error::new(io::ErrorKind::ConnectionAborted, os(libc::EINVAL));
        assert_eq!(AcceptFailure::of(&gone), AcceptFailure::Connection, "gone as it was set up");
    }

    #[test]
    fn the_throttle_lets_one_through_and_counts_the_rest() {
        let t = Throttle::default();
        assert_eq!(t.admit(), Some(0));
        assert_eq!(t.admit(), None);
        assert_eq!(t.admit(), None);
        t.0.lock().unwrap().last = std::time::Instant::now().checked_sub(WARN_EVERY);
        assert_eq!(t.admit(), Some(2), "the next one says how many were left out");
    }
}
