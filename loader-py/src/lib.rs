//! `shardstream._native`: the Rust side of the Python package. Thin on purpose: connect, open,
//! stream, hand batches to Python, map errors to Python exceptions, and run the CLI and the
//! embedded daemon. The Python layer (`python/shardstream/`) holds the user-facing API.
//!
//! Three rules of this bridge:
//! - the GIL is released while waiting on the daemon, and signals are checked every
//!   [`SIGNAL_CHECK`] so Ctrl-C interrupts a blocked iteration;
//! - the tokio runtime is per process and re-created lazily after `fork` (DataLoader workers): a
//!   runtime's threads do not survive fork, so a child never touches its parent's runtime;
//! - batches reach Python without a copy: a [`Buffer`] owns the received bytes and exposes them
//!   through the buffer protocol; per-sample `memoryview` slices keep it alive.

mod arrow;
mod batch;
mod errors;
mod runtime;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use shardstream_client::{Address, BatchStream, Client};
use shardstream_proto::{Collate, StreamRequest, Transport};

use crate::errors::to_pyerr;
use crate::runtime::{block_on, runtime};

/// How often a blocked call wakes up to let Python handle signals (Ctrl-C).
const SIGNAL_CHECK: Duration = Duration::from_millis(100);

/// How long a wait for the next batch lasts, with every credit held by the process's own
/// batches, before a `RuntimeWarning` says so. A trainer's batches are let go within a step, so
/// a wait this long is the loop or a transform keeping them; another thread may yet let go, so
/// it is a warning and the wait goes on.
const STALL_WARNING: Duration = Duration::from_secs(5);

/// Connects (or reconnects after fork) to a daemon.
#[pyclass(module = "shardstream._native")]
struct Connection {
    address: Address,
    /// (pid that made the client, client): a client made before fork belongs to the parent's
    /// runtime and must not be used in the child.
    client: Mutex<Option<(u32, Client)>>,
}

impl Connection {
    fn client(&self, py: Python<'_>) -> PyResult<Client> {
        let pid = std::process::id();
        if let Some((owner, c)) = self.client.lock().unwrap_or_else(|p| p.into_inner()).as_ref()
            && *owner == pid
        {
            return Ok(c.clone());
        }
        // Connected without the lock: the wait gives up the GIL, and a thread that holds the GIL
        // while it waits for the lock would never let this one have it back (a child's threads
        // making their first calls after fork hung so). Two threads may both connect; the first
        // to finish is kept.
        let addr = self.address.clone();
        let c = block_on(py, async move { shardstream_client::connect(&addr).await })?.map_err(to_pyerr)?;
        let mut guard = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((owner, kept)) = guard.as_ref()
            && *owner == pid
        {
            return Ok(kept.clone());
        }
        if let Some(inherited) = guard.replace((pid, c.clone())) {
            forget_if_inherited(inherited);
        }
        Ok(c)
    }
}

/// Drops a client, unless it was made before fork by another process: its channel's task lives
/// in that process's runtime, and dropping the channel wakes that task, which takes the runtime's
/// scheduler lock. A parent thread may have held that lock at the moment of fork, and then the
/// child waits for it for ever (DataLoader workers hung in their first garbage collection). Such
/// a client is leaked instead: the child's copy of its memory goes with the child.
fn forget_if_inherited((owner, client): (u32, Client)) {
    if owner == std::process::id() {
        drop(client);
    } else {
        std::mem::forget(client);
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(c) = self.client.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            forget_if_inherited(c);
        }
    }
}

#[pymethods]
impl Connection {
    #[new]
    fn new(py: Python<'_>, address: &str) -> PyResult<Self> {
        errors::no_panic("Connection()", || {
            let address: Address = address.parse().map_err(to_pyerr)?;
            let conn = Self { address, client: Mutex::new(None) };
            conn.client(py)?;
            Ok(conn)
        })
    }

    #[getter]
    fn address(&self) -> String {
        self.address.to_string()
    }

    /// Opens a dataset and returns its description as a dict.
    #[pyo3(signature = (url, cache = "auto"))]
    fn open<'py>(&self, py: Python<'py>, url: String, cache: &str) -> PyResult<Bound<'py, PyDict>> {
        errors::no_panic("Connection.open", || {
            let mut c = self.client(py)?;
            let cache = cache.to_owned();
            let info =
                block_on(py, async move { shardstream_client::open(&mut c, &url, &cache).await })?.map_err(to_pyerr)?;
            let d = PyDict::new(py);
            d.set_item("fingerprint", info.fingerprint)?;
            d.set_item("num_samples", info.num_samples)?;
            d.set_item("num_shards", info.num_shards)?;
            d.set_item("total_bytes", info.total_bytes)?;
            d.set_item("fields", info.fields)?;
            d.set_item("format", info.format)?;
            d.set_item("from_manifest", info.from_manifest)?;
            // Arrow datasets (Parquet): the schema as an Arrow IPC schema message, else empty.
            d.set_item("arrow_schema", pyo3::types::PyBytes::new(py, &info.arrow_schema))?;
            Ok(d)
        })
    }

    /// Daemon status as a dict.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        errors::no_panic("Connection.status", || {
            let mut c = self.client(py)?;
            let r = block_on(py, async move {
                let r = c.status(shardstream_proto::StatusRequest {}).await;
                r.map_err(|s| c.first_answer(s))
            })?
            .map_err(to_pyerr)?
            .into_inner();
            let d = PyDict::new(py);
            d.set_item("version", r.version)?;
            d.set_item("uptime_ms", r.uptime_ms)?;
            d.set_item("active_streams", r.active_streams)?;
            d.set_item("streams_total", r.streams_total)?;
            d.set_item("samples_served", r.samples_served)?;
            d.set_item("bytes_served", r.bytes_served)?;
            d.set_item("cache_dir", r.cache_dir)?;
            d.set_item("shm_sessions", r.shm_sessions)?;
            d.set_item("leased_shards", r.leased_shards)?;
            d.set_item("ring_bytes", r.ring_bytes)?;
            d.set_item("kept_rings", r.kept_rings)?;
            d.set_item("kept_ring_bytes", r.kept_ring_bytes)?;
            d.set_item("rings_made", r.rings_made)?;
            d.set_item("rings_reused", r.rings_reused)?;
            if let Some(c) = r.cache {
                let cache = PyDict::new(py);
                cache.set_item("capacity_bytes", c.capacity_bytes)?;
                cache.set_item("configured_capacity_bytes", c.configured_capacity_bytes)?;
                cache.set_item("used_bytes", c.used_bytes)?;
                cache.set_item("shards", c.shards)?;
                cache.set_item("hits", c.hits)?;
                cache.set_item("misses", c.misses)?;
                cache.set_item("evictions", c.evictions)?;
                cache.set_item("filled_bytes", c.filled_bytes)?;
                cache.set_item("high_water_bytes", c.high_water_bytes)?;
                cache.set_item("decoded_row_groups", c.decoded_row_groups)?;
                cache.set_item("decoded_bytes", c.decoded_bytes)?;
                cache.set_item("policy", c.policy)?;
                d.set_item("cache", cache)?;
            }
            d.set_item("storage_bytes", r.storage_bytes)?;
            d.set_item("storage_requests", r.storage_requests)?;
            d.set_item("storage_retries", r.storage_retries)?;
            d.set_item("prefetch_horizon_s", r.prefetch_horizon_s)?;
            let consumers: Vec<(String, u32, u32, u64, f64, f64)> = r
                .consumers
                .into_iter()
                .map(|c| (c.url, c.rank, c.worker, c.position, c.samples_per_s, c.wait_s))
                .collect();
            d.set_item("consumers", consumers)?;
            let datasets: Vec<(String, u64, u64)> =
                r.datasets.into_iter().map(|ds| (ds.url, ds.resident_shard_tables, ds.resident_index_bytes)).collect();
            d.set_item("datasets", datasets)?;
            d.set_item("rdma_provider", r.rdma_provider)?;
            d.set_item("rdma_streams", r.rdma_streams)?;
            d.set_item("rdma_ring_bytes", r.rdma_ring_bytes)?;
            d.set_item("rdma_staging_bytes", r.rdma_staging_bytes)?;
            d.set_item("rdma_budget_bytes", r.rdma_budget_bytes)?;
            d.set_item("decoded_memory_bytes", r.decoded_memory_bytes)?;
            d.set_item("decoded_budget_bytes", r.decoded_budget_bytes)?;
            d.set_item("inline_queued_bytes", r.inline_queued_bytes)?;
            d.set_item("inline_budget_bytes", r.inline_budget_bytes)?;
            Ok(d)
        })
    }

    /// Starts one consumer's stream; errors in the request are raised here.
    #[pyo3(signature = (url, *, batch_size, shuffle, seed, epoch, rank, world_size, worker, num_workers,
                        start_batch, drop_last, fields, shuffle_window, transport, expected_fingerprint,
                        cache = "auto", collate = None, batches_per_message = 1, binary_views = false))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        py: Python<'_>,
        url: String,
        batch_size: u32,
        shuffle: bool,
        seed: u64,
        epoch: u64,
        rank: u32,
        world_size: u32,
        worker: u32,
        num_workers: u32,
        start_batch: u64,
        drop_last: bool,
        fields: Vec<String>,
        shuffle_window: u32,
        transport: &str,
        expected_fingerprint: String,
        cache: &str,
        collate: Option<&str>,
        batches_per_message: u32,
        binary_views: bool,
    ) -> PyResult<Stream> {
        errors::no_panic("Connection.stream", || {
            let collate = match collate {
                None => Collate::None,
                Some("stack") => Collate::Stack,
                Some(other) => {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "collate must be None or \"stack\", not {other:?}"
                    )));
                }
            };
            let transport = match transport {
                "auto" => Transport::Auto,
                "inline" => Transport::Inline,
                "shm" => Transport::Shm,
                "rdma" => Transport::Rdma,
                other => {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "transport must be \"auto\", \"shm\", \"rdma\" or \"inline\", not {other:?}"
                    )));
                }
            };
            let req = StreamRequest {
                url,
                fields,
                batch_size,
                shuffle,
                seed,
                epoch,
                rank,
                world_size,
                worker,
                num_workers,
                start_batch,
                drop_last,
                shuffle_window,
                transport: transport as i32,
                expected_fingerprint,
                cache: cache.to_owned(),
                collate: collate as i32,
                rdma_offer: None,
                max_batches_per_message: batches_per_message,
                packed_keys_joined: true,
                arrow_binary_views: binary_views,
                arrow_parts_joined: true,
            };
            let mut c = self.client(py)?;
            let daemon = self.address.clone();
            let inner = block_on(py, async move { shardstream_client::stream_from(&mut c, req, Some(&daemon)).await })?
                .map_err(to_pyerr)?;
            let fields = std::sync::Arc::new(inner.header.fields.clone());
            Ok(Stream {
                header: inner.header.clone(),
                state: Mutex::new(StreamState::Idle(Box::new(inner))),
                closed: tokio_util::sync::CancellationToken::new(),
                pid: std::process::id(),
                fields,
                stall_warned: std::sync::atomic::AtomicBool::new(false),
            })
        })
    }
}

/// Says why a wait for the next batch does not end: the process holds every credit.
fn warn_held_every_credit(py: Python<'_>, held: usize, credits: u32) -> PyResult<()> {
    let message = format!(
        "shardstream: waited {} s for the next batch while this process holds all {credits} of the stream's \
         credits ({held} batches not released). The daemon cannot make another batch until one is: let batches \
         go once used, and keep copies (np.array(x), tensor.clone(); np.asarray(x) is a view) rather than batches \
         or views of them, or make the Loader with copy=True; a transform's result that views its batch keeps \
         the batch too. The wait goes on.",
        STALL_WARNING.as_secs()
    );
    let message = std::ffi::CString::new(message).unwrap_or_default();
    PyErr::warn(py, &py.get_type::<pyo3::exceptions::PyRuntimeWarning>(), &message, 1)
}

/// Where a stream stands. The stream is taken out while a thread waits on it, so another thread
/// can close it meanwhile without waiting for the next batch.
enum StreamState {
    // Boxed: a BatchStream is large next to the other states.
    Idle(Box<BatchStream>),
    /// A thread is waiting for the next batch.
    Busy,
    Done,
}

/// One consumer's batch stream. Usable from any thread (iterated on one, closed or collected on
/// another): its state sits behind a lock, and `close` wakes a thread blocked in `next_batch`.
#[pyclass(module = "shardstream._native", frozen)]
struct Stream {
    state: Mutex<StreamState>,
    closed: tokio_util::sync::CancellationToken,
    header: shardstream_proto::StreamHeader,
    pid: u32,
    fields: std::sync::Arc<Vec<String>>,
    /// The stream has said once that the process holds every credit ([`STALL_WARNING`]).
    stall_warned: std::sync::atomic::AtomicBool,
}

impl Stream {
    fn lock(&self) -> std::sync::MutexGuard<'_, StreamState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands the stream back after a wait, unless `close` came meanwhile (checked under the lock
    /// `close` takes after cancelling, so a close is never missed).
    fn put_back(&self, stream: BatchStream) {
        let mut state = self.lock();
        if self.closed.is_cancelled() {
            *state = StreamState::Done;
            drop(state);
            self.dispose(stream);
        } else {
            *state = StreamState::Idle(Box::new(stream));
        }
    }

    /// Drops a stream; in a forked child the stream's task lives in the parent's runtime, so it
    /// is leaked instead (dropping it there could block on threads that do not exist).
    fn dispose(&self, stream: BatchStream) {
        if self.pid == std::process::id() {
            drop(stream);
        } else {
            std::mem::forget(stream);
        }
    }
}

#[pymethods]
impl Stream {
    /// The stream header: transport, per-rank totals, fields.
    #[getter]
    fn header<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        errors::no_panic("Stream.header", || {
            let d = PyDict::new(py);
            let h = &self.header;
            let transport = match Transport::try_from(h.transport) {
                Ok(Transport::Shm) => "shm".to_owned(),
                Ok(Transport::Rdma) => format!("rdma/{}", h.rdma_provider),
                _ => "inline".to_owned(),
            };
            d.set_item("transport", transport)?;
            d.set_item("fingerprint", &h.fingerprint)?;
            d.set_item("samples_per_rank", h.samples_per_rank)?;
            d.set_item("batches_per_rank", h.batches_per_rank)?;
            d.set_item("batches_in_stream", h.batches_in_stream)?;
            d.set_item("padded_samples", h.padded_samples)?;
            d.set_item("dropped_samples", h.dropped_samples)?;
            d.set_item("fields", h.fields.clone())?;
            d.set_item("packed", h.packed)?;
            let format = match shardstream_proto::BatchFormat::try_from(h.batch_format) {
                Ok(shardstream_proto::BatchFormat::Arrow) => "arrow",
                _ => "samples",
            };
            d.set_item("batch_format", format)?;
            d.set_item("binary_views", h.arrow_binary_views)?;
            Ok(d)
        })
    }

    /// The next batch, or None at the end (or once closed). Waits with the GIL released; Ctrl-C
    /// interrupts, and so does `close()` from another thread.
    fn next_batch(&self, py: Python<'_>) -> PyResult<Option<batch::Batch>> {
        errors::no_panic("Stream.next_batch", || {
            if self.pid != std::process::id() {
                return Err(pyo3::exceptions::PyRuntimeError::new_err(
                    "a shardstream stream cannot be used across fork; start a new iteration in the child",
                ));
            }
            // Its own statement: a guard in the match scrutinee would live through the arms.
            let taken = std::mem::replace(&mut *self.lock(), StreamState::Busy);
            let mut stream = match taken {
                StreamState::Idle(s) => *s,
                StreamState::Done => {
                    *self.lock() = StreamState::Done;
                    return Ok(None);
                }
                StreamState::Busy => {
                    return Err(pyo3::exceptions::PyRuntimeError::new_err(
                        "this shardstream stream is already being iterated on another thread",
                    ));
                }
            };
            let closed = self.closed.clone();
            let next = loop {
                let waited = block_on(py, async {
                    let next = async {
                        tokio::select! {
                            n = stream.next() => Some(n),
                            _ = closed.cancelled() => None,
                        }
                    };
                    // Both arms are cancel-safe: a batch that arrives is never lost to the timeout.
                    tokio::time::timeout(STALL_WARNING, next).await.ok()
                });
                match waited {
                    Ok(Some(next)) => break Ok(next),
                    Ok(None) => {}
                    Err(interrupted) => break Err(interrupted),
                }
                // A warning filter that turns it into an exception: as Ctrl-C, the stream stays
                // usable.
                if let Some((held, credits)) = stream.held_every_credit()
                    && !self.stall_warned.swap(true, std::sync::atomic::Ordering::Relaxed)
                    && let Err(raised) = warn_held_every_credit(py, held, credits)
                {
                    break Err(raised);
                }
            };
            let next = match next {
                Ok(Some(n)) if !self.closed.is_cancelled() => n,
                Ok(_) => {
                    // Closed meanwhile: end quietly, like an iteration that was closed between
                    // two batches.
                    *self.lock() = StreamState::Done;
                    self.dispose(stream);
                    return Ok(None);
                }
                Err(interrupted) => {
                    // Ctrl-C: the stream stays usable.
                    self.put_back(stream);
                    return Err(interrupted);
                }
            };
            match next {
                None => {
                    *self.lock() = StreamState::Done;
                    self.dispose(stream);
                    Ok(None)
                }
                Some(Ok(b)) => {
                    let session = stream.shm.clone();
                    self.put_back(stream);
                    Ok(Some(batch::Batch::new(b, session, self.fields.clone(), self.header.batch_format)?))
                }
                Some(Err(e)) => {
                    *self.lock() = StreamState::Done;
                    self.dispose(stream);
                    Err(to_pyerr(e))
                }
            }
        })
    }

    /// Ends the stream early (the daemon notices at once and stops reading for it). Safe from
    /// any thread; a thread blocked in `next_batch` returns None.
    fn close(&self) -> PyResult<()> {
        errors::no_panic("Stream.close", || {
            self.closed.cancel();
            let mut state = self.lock();
            match std::mem::replace(&mut *state, StreamState::Done) {
                StreamState::Idle(s) => {
                    drop(state);
                    self.dispose(*s);
                }
                // The waiting thread wakes up, sees the token and drops the stream itself.
                StreamState::Busy => *state = StreamState::Busy,
                StreamState::Done => {}
            }
            Ok(())
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let state = std::mem::replace(self.state.get_mut().unwrap_or_else(|p| p.into_inner()), StreamState::Done);
        if let StreamState::Idle(s) = state {
            self.dispose(*s);
        }
    }
}

/// Starts a daemon inside this process, listening on `socket` (a path), and returns its address.
/// It runs on this process's runtime threads until the process exits.
#[pyfunction]
fn start_embedded_server(py: Python<'_>, socket: PathBuf, cache_dir: PathBuf) -> PyResult<String> {
    errors::no_panic("start_embedded_server", || {
        use shardstream::daemon::{BoundDaemon, DaemonConfig};
        // The daemon's decoder catches arrow-rs's panics on damaged pages and serves a
        // ShardError; without this the process's hook would also print each one to the user.
        // Every other panic still goes to that hook (no log subscriber is installed here).
        shardstream::panics::install_hook();
        let config = DaemonConfig::new(Address::Unix(socket), cache_dir);
        let bound = block_on(py, async move { BoundDaemon::bind(config).await })?.map_err(errors::daemon_error)?;
        let address = bound.address().to_string();
        let token = shardstream::daemon::ShutdownToken::new();
        runtime().spawn(async move {
            if let Err(e) = bound.run(token).await {
                eprintln!("shardstream embedded server stopped: {e}");
            }
        });
        Ok(address)
    })
}

/// True when a daemon answers at `address` (used by connect="auto").
#[pyfunction]
fn probe(py: Python<'_>, address: &str) -> PyResult<bool> {
    errors::no_panic("probe", || {
        let Ok(addr) = address.parse::<Address>() else { return Ok(false) };
        block_on(py, async move {
            tokio::time::timeout(Duration::from_secs(2), shardstream_client::connect(&addr))
                .await
                .is_ok_and(|r| r.is_ok())
        })
    })
}

/// Loads libfabric and initialises its providers without opening anything (for a parent about
/// to fork rdma workers); raises the reason libfabric cannot be had.
#[pyfunction]
fn fabric_warm_up(py: Python<'_>) -> PyResult<()> {
    errors::no_panic("fabric_warm_up", || py.detach(shardstream_client::rdma::warm_up).map_err(errors::to_pyerr))
}

/// Whether `transport="auto"` would take rdma toward a daemon serving it over `provider` (by its
/// name alone: whether this host opens it is the stream's to find out), so the trainer can load
/// libfabric before it forks DataLoader workers.
#[pyfunction]
fn rdma_auto_picks(provider: &str) -> bool {
    shardstream_client::rdma::auto_picks(provider)
}

/// Panics inside the panic guard every entry point uses: lets the tests check that a Rust panic
/// reaches Python as `ShardstreamError`, never as `PanicException`.
#[pyfunction]
fn _panic_for_tests() -> PyResult<()> {
    errors::no_panic("_panic_for_tests", || panic!("a deliberate panic, to test the guard"))
}

/// Runs the `shardstream` command line with `argv` (argv[0] included); returns the exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    errors::no_panic("cli_main", || Ok(py.detach(|| shardstream::cli::main_with_args(argv))))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Connection>()?;
    m.add_class::<Stream>()?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<arrow::ArrowReader>()?;
    m.add_class::<arrow::ArrowBatch>()?;
    m.add_class::<batch::Buffer>()?;
    m.add_class::<batch::Region>()?;
    m.add_class::<batch::Column>()?;
    m.add_function(wrap_pyfunction!(start_embedded_server, m)?)?;
    m.add_function(wrap_pyfunction!(probe, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(fabric_warm_up, m)?)?;
    m.add_function(wrap_pyfunction!(rdma_auto_picks, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_tests, m)?)?;
    errors::register(m)?;
    m.add("__version__", shardstream::VERSION)?;
    m.add("DEFAULT_SOCKET", shardstream_proto::DEFAULT_SOCKET)?;
    m.add("MAX_BATCH_SIZE", shardstream_proto::MAX_BATCH_SIZE)?;
    m.add("MAX_WORLD_SIZE", shardstream::plan::MAX_WORLD_SIZE)?;
    m.add("DEFAULT_SHUFFLE_WINDOW", shardstream::service::DEFAULT_SHUFFLE_WINDOW)?;
    Ok(())
}
