//! Batches as Python sees them: a dict of `"__key__"` -> list of str and, per field, a list of
//! read-only `memoryview`s, or `bytes` objects when a copy is asked for (DataLoader workers must
//! pickle their batches, and memoryviews cannot be pickled).
//!
//! - Inline batches: the views point into one [`Buffer`] that owns the received message bytes.
//! - Shared-memory batches: the views point straight into the client's read-only mapping of the
//!   shard (a [`Region`] per shard of the batch): no copy at all between the page cache and the
//!   trainer. Each region holds the batch's [`Lease`]; when the last view and the batch object are
//!   gone (or on an explicit `release()`), the lease is returned to the daemon. Shards of a
//!   dataset read in place (`SHARD_MUTABLE`: someone may truncate them, and a mapping would then
//!   be SIGBUS) are read instead, into one [`Buffer`] per batch that holds the lease the same way.
//! - Packed batches (`collate="stack"`): each field is one `(samples, record_bytes)` `uint8` numpy
//!   array over a [`Column`] of the stream's read-only ring mapping: the daemon's one copy is the
//!   only one. The column holds the batch's [`Lease`] on its ring slot; when every array is gone
//!   (or on `release()`) the slot goes back to the daemon, which then reuses it: unlike the shard
//!   views of view mode, an array must not be used after an explicit `release()`.
//! - Arrow batches (Parquet datasets): `ipc()` hands out the batch's Arrow IPC stream as one
//!   read-only buffer object, a [`Column`] over the IPC bytes in the ring slot (shared memory,
//!   holding the slot's [`Lease`]) or a [`Buffer`] over the received message (inline); the
//!   Python layer opens it with `pyarrow.ipc.read_record_batch`, whose arrays then point into it.
//!   A batch with view columns (`binary_views`) is opened in native code instead (`crate::arrow`)
//!   over `arrow_bytes()`: arrow buffers over the same bytes, holding the same lease, and over
//!   the view segments' mappings.

use std::ffi::{c_int, c_void};
use std::ptr;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView, PyString};
use shardstream_client::shm::{Mapping, RingMapping, ShmSession};
use shardstream_proto::{ArrowBatch, FieldColumn, InlineBatch, PackedBatch, ShmBatch};

use crate::errors::ShardstreamError;

/// Fills a read-only, one-dimensional byte `Py_buffer` over `data`, owned by `owner`.
///
/// # Safety
/// `view` must be the non-null pointer CPython passed to `__getbuffer__`, and `data` must stay
/// valid and unchanged for as long as `owner` is alive (the view holds a reference to it).
unsafe fn fill_view(owner: Bound<'_, PyAny>, data: &[u8], view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
    if view.is_null() {
        return Err(PyBufferError::new_err("null view"));
    }
    if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
        return Err(PyBufferError::new_err("shardstream buffers are read-only"));
    }
    let len = isize::try_from(data.len()).map_err(|_| PyBufferError::new_err("buffer too large"))?;
    // SAFETY: per this function's contract; every field of the view is initialised, and `obj`
    // takes a strong reference that CPython releases in PyBuffer_Release.
    unsafe {
        (*view).buf = data.as_ptr() as *mut c_void;
        (*view).len = len;
        (*view).readonly = 1;
        (*view).itemsize = 1;
        (*view).format =
            if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT { c"B".as_ptr() as *mut _ } else { ptr::null_mut() };
        (*view).ndim = 1;
        (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND { &mut (*view).len } else { ptr::null_mut() };
        (*view).strides =
            if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES { &mut (*view).itemsize } else { ptr::null_mut() };
        (*view).suboffsets = ptr::null_mut();
        (*view).internal = ptr::null_mut();
        (*view).obj = owner.into_ptr();
    }
    Ok(())
}

/// A batch's hold on its shards; returned to the daemon once, when dropped or released.
pub struct Lease {
    session: Arc<ShmSession>,
    batch: u64,
    released: AtomicBool,
    /// The ring slot (ring, its id, slot) of a batch whose memory was handed out writable (torch
    /// tensors, `Batch.may_be_written`): what this process wrote there is dropped before the
    /// slot goes back, or the slot's next batches would read it.
    written: OnceLock<(Arc<RingMapping>, u64, u32)>,
}

impl Lease {
    fn new(session: &Arc<ShmSession>, batch: u64) -> Arc<Self> {
        Arc::new(Self { session: session.clone(), batch, released: AtomicBool::new(false), written: OnceLock::new() })
    }

    /// Drops this process's writes into the slot, if any could have been made.
    fn discard_writes(&self) {
        if let Some((ring, id, slot)) = self.written.get() {
            self.session.close_slot(ring, *id, *slot);
        }
    }

    /// Done with the batch: the release may wait for a few more ([`ShmSession::release`]).
    fn release(&self) {
        if !self.released.swap(true, Ordering::AcqRel) {
            self.discard_writes();
            self.session.release(self.batch);
        }
    }

    /// The user asked for the release: sent now, with any held back.
    fn release_now(&self) {
        if !self.released.swap(true, Ordering::AcqRel) {
            self.discard_writes();
            self.session.release_now(self.batch);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

/// A shard's mapping as a read-only buffer, holding the lease of the batch that uses it (a
/// decoded row group's segment holds none: nothing the daemon reuses lies in it).
#[pyclass(module = "shardstream._native", frozen)]
pub struct Region {
    map: Arc<Mapping>,
    _lease: Option<Arc<Lease>>,
}

#[pymethods]
impl Region {
    fn __len__(&self) -> usize {
        self.map.bytes().len()
    }

    /// # Safety
    /// The mapping is read-only and lives as long as this object (an `Arc` it holds), which the
    /// view keeps alive; see `shardstream_client::shm` for why its length does not change.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        crate::errors::no_panic("Region.__getbuffer__", || {
            let map = slf.get().map.clone();
            // SAFETY: `map` is kept alive by `slf`, which the view references.
            unsafe { fill_view(slf.into_any(), map.bytes(), view, flags) }
        })
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// One field's column in a ring slot as a read-only buffer, holding the lease of its batch's slot.
#[pyclass(module = "shardstream._native", frozen)]
pub struct Column {
    ring: Arc<RingMapping>,
    slot: u32,
    range: std::ops::Range<usize>,
    _lease: Arc<Lease>,
}

impl Column {
    /// The column's bytes in `ring` (a clone of `self.ring`, so a caller can hand out the bytes
    /// while giving `self` away). The range was checked against the slot by `read_slot`.
    fn bytes_in<'r>(&self, ring: &'r RingMapping) -> &'r [u8] {
        ring.slot(self.slot).and_then(|s| s.get(self.range.clone())).unwrap_or_default()
    }
}

#[pymethods]
impl Column {
    fn __len__(&self) -> usize {
        self.bytes_in(&self.ring).len()
    }

    /// # Safety
    /// The ring mapping is read-only and lives as long as this object (an `Arc` it holds), which
    /// the view keeps alive; the daemon does not write into the slot while the lease is held.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        crate::errors::no_panic("Column.__getbuffer__", || {
            let ring = slf.get().ring.clone();
            let bytes = slf.get().bytes_in(&ring);
            // SAFETY: `bytes` lies in the mapping kept alive by `slf`, which the view references.
            unsafe { fill_view(slf.into_any(), bytes, view, flags) }
        })
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// Read-only bytes owned by Rust, exposed through the buffer protocol.
#[pyclass(module = "shardstream._native", frozen)]
pub struct Buffer {
    data: Bytes,
    /// For samples copied out of a shard read in place: the batch's lease, held as a view into
    /// a mapped shard would hold it, so leases follow views the same way on every shard.
    _lease: Option<Arc<Lease>>,
}

#[pymethods]
impl Buffer {
    fn __len__(&self) -> usize {
        self.data.len()
    }

    /// # Safety
    /// The pointer handed out stays valid while the view holds its reference to this object:
    /// `Bytes` never moves or frees its storage while a handle exists, and the object is frozen.
    /// The buffer is read-only; writable requests are refused.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        crate::errors::no_panic("Buffer.__getbuffer__", || {
            let data = slf.get().data.clone();
            // SAFETY: `data` shares storage with the field of `slf`, which the view references.
            unsafe { fill_view(slf.into_any(), &data, view, flags) }
        })
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// One received batch.
#[pyclass(module = "shardstream._native", frozen)]
pub struct Batch {
    kind: Kind,
    /// Fields to hand out, in order (the stream's fields).
    fields: Arc<Vec<String>>,
    /// Payload bytes of the handed-out fields, known once `to_dict` has parsed a shm batch.
    payload: std::sync::atomic::AtomicU64,
}

enum Kind {
    Inline(InlineBatch),
    Shm {
        batch: ShmBatch,
        session: Arc<ShmSession>,
        lease: Arc<Lease>,
    },
    Packed {
        batch: PackedBatch,
        session: Arc<ShmSession>,
        lease: Arc<Lease>,
    },
    /// `data`: the inline IPC stream (taken out of `batch`, shared with the buffers handed out);
    /// `shm`: the session and lease when the stream lies in a ring slot.
    Arrow {
        batch: ArrowBatch,
        data: Bytes,
        shm: Option<(Arc<ShmSession>, Arc<Lease>)>,
    },
}

impl Batch {
    pub fn new(
        b: shardstream_client::Batch,
        session: Option<Arc<ShmSession>>,
        fields: Arc<Vec<String>>,
        batch_format: i32,
    ) -> PyResult<Self> {
        // Samples kinds are read as TAR members / fields / packed slots, Arrow batches as Arrow
        // IPC: a batch whose kind is not the stream's announced format must never get that far
        // (the client already refuses them; this is the last line).
        let arrow = shardstream_client::stream_format(batch_format).map_err(crate::errors::to_pyerr)?
            == shardstream_proto::BatchFormat::Arrow;
        if arrow != matches!(b, shardstream_client::Batch::Arrow(_)) {
            return Err(ShardstreamError::new_err(format!(
                "batch {} is not of the stream's batch format ({})",
                b.index(),
                if arrow { "Arrow record batches" } else { "samples" }
            )));
        }
        let kind = match (b, session) {
            (shardstream_client::Batch::Inline(b), _) => Kind::Inline(b),
            (shardstream_client::Batch::Shm(b), Some(session)) => {
                let lease = Lease::new(&session, b.batch_index);
                Kind::Shm { batch: b, session, lease }
            }
            (shardstream_client::Batch::Packed(b), Some(session)) => {
                let lease = Lease::new(&session, b.batch_index);
                Kind::Packed { batch: b, session, lease }
            }
            (shardstream_client::Batch::Arrow(mut b), session) if !b.data.is_empty() => {
                // Inline (or read in place in an rdma ring slot), even on a shm stream: nothing
                // to release.
                drop(session);
                let data = std::mem::take(&mut b.data);
                Kind::Arrow { batch: b, data, shm: None }
            }
            (shardstream_client::Batch::Arrow(b), Some(session)) => {
                let lease = Lease::new(&session, b.batch_index);
                Kind::Arrow { batch: b, data: Bytes::new(), shm: Some((session, lease)) }
            }
            (_, None) => {
                return Err(ShardstreamError::new_err("shared-memory batch on a stream without a side channel"));
            }
        };
        Ok(Self { kind, fields, payload: std::sync::atomic::AtomicU64::new(u64::MAX) })
    }

    fn nbytes_unguarded(&self) -> u64 {
        match &self.kind {
            Kind::Inline(b) => b.fields.iter().flat_map(|f| f.lengths.iter()).sum(),
            Kind::Shm { batch, .. } => match self.payload.load(Ordering::Relaxed) {
                u64::MAX => batch.lengths.iter().sum(),
                known => known,
            },
            Kind::Packed { .. } => match self.payload.load(Ordering::Relaxed) {
                u64::MAX => 0,
                known => known,
            },
            Kind::Arrow { batch, data, .. } => batch.length.max(data.len() as u64),
        }
    }
}

/// What an Arrow batch's record batch is built over: its IPC stream and its views' segments, as
/// arrow buffers that hold what keeps the bytes valid (the slot's lease and the ring mapping,
/// the received message, the segments' mappings).
pub(crate) struct ArrowBytes {
    pub index: u64,
    pub rows: usize,
    pub ipc: arrow_buffer::Buffer,
    pub views: Vec<arrow_buffer::Buffer>,
}

/// Keeps a ring slot's bytes valid for an arrow buffer over them: the mapping, and the lease
/// under which the daemon does not write into the slot.
struct SlotOwner {
    _ring: Arc<RingMapping>,
    _lease: Arc<Lease>,
}

// The owners are only dropped, never read through, by arrow: a panic elsewhere leaves them as
// they were.
impl std::panic::RefUnwindSafe for SlotOwner {}

/// Keeps a view segment's mapping alive for an arrow buffer over it.
struct SegmentOwner(#[allow(dead_code)] Arc<Mapping>);

impl std::panic::RefUnwindSafe for SegmentOwner {}

/// An arrow buffer over `bytes`, which `owner` keeps valid.
///
/// # Safety
/// `bytes` must stay valid and unchanged while `owner` is alive.
unsafe fn owned_buffer(bytes: &[u8], owner: Arc<dyn arrow_buffer::alloc::Allocation>) -> arrow_buffer::Buffer {
    let ptr = ptr::NonNull::new(bytes.as_ptr() as *mut u8).unwrap_or(ptr::NonNull::dangling());
    // SAFETY: per this function's contract; arrow only reads through the pointer.
    unsafe { arrow_buffer::Buffer::from_custom_allocation(ptr, bytes.len(), owner) }
}

/// The ring of an Arrow batch in shared memory and where its IPC stream lies in its slot, checked
/// against the slot's header and bounds (`arrow_ipc_range`).
fn arrow_slot(batch: &ArrowBatch, session: &ShmSession) -> PyResult<(Arc<RingMapping>, std::ops::Range<usize>)> {
    let ring = session.ring(batch.ring).map_err(crate::errors::to_pyerr)?;
    let slot = ring.slot(batch.slot).ok_or_else(|| {
        ShardstreamError::new_err(format!(
            "arrow batch {} names slot {} of a ring of {} slots",
            batch.batch_index, batch.slot, ring.header.slot_count
        ))
    })?;
    let range = shardstream_client::shm::arrow_ipc_range(
        slot,
        batch.slot,
        batch.batch_index,
        batch.row_ids.len() as u64,
        batch.length,
    )
    .map_err(|e| ShardstreamError::new_err(format!("arrow batch {}: {e}", batch.batch_index)))?;
    Ok((ring, range))
}

impl Batch {
    /// The bytes an Arrow batch's record batch is built over (see [`ArrowBytes`]): the stream
    /// checked against its slot's bounds and header as `ipc()` checks it, each view segment to
    /// be mapped.
    pub(crate) fn arrow_bytes(&self) -> PyResult<ArrowBytes> {
        let Kind::Arrow { batch, data, shm } = &self.kind else {
            return Err(ShardstreamError::new_err("not an Arrow batch (Parquet dataset); use to_dict()"));
        };
        let (index, rows) = (batch.batch_index, batch.row_ids.len());
        let Some((session, lease)) = shm else {
            return Ok(ArrowBytes { index, rows, ipc: arrow_buffer::Buffer::from(data.clone()), views: Vec::new() });
        };
        let (ring, range) = arrow_slot(batch, session)?;
        let bytes = ring.slot(batch.slot).and_then(|s| s.get(range)).unwrap_or_default();
        let owner = Arc::new(SlotOwner { _ring: ring.clone(), _lease: lease.clone() });
        // SAFETY: the slot lies in the ring's read-only mapping, which `owner` keeps mapped; the
        // daemon does not write into the slot while the lease `owner` holds is out.
        let ipc = unsafe { owned_buffer(bytes, owner) };
        let views = batch
            .view_slots
            .iter()
            .map(|&k| {
                let map = session.mapping(k).map_err(crate::errors::to_pyerr)?;
                if !map.is_mapped() && !map.bytes().is_empty() {
                    return Err(ShardstreamError::new_err(format!(
                        "arrow batch {index}: view segment in slot {k} is not mapped"
                    )));
                }
                let bytes: *const [u8] = map.bytes();
                // SAFETY: the segment is a sealed, read-only mapping, which the owner keeps
                // mapped (`bytes` points into it, not into the `Arc`).
                Ok(unsafe { owned_buffer(&*bytes, Arc::new(SegmentOwner(map))) })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(ArrowBytes { index, rows, ipc, views })
    }
}

#[pymethods]
impl Batch {
    /// Index of this batch in the rank's batch order.
    #[getter]
    fn index(&self) -> u64 {
        match &self.kind {
            Kind::Inline(b) => b.batch_index,
            Kind::Shm { batch, .. } => batch.batch_index,
            Kind::Packed { batch, .. } => batch.batch_index,
            Kind::Arrow { batch, .. } => batch.batch_index,
        }
    }

    fn __len__(&self) -> usize {
        match &self.kind {
            Kind::Inline(b) => b.keys.len(),
            Kind::Shm { batch, .. } => batch.slots.len(),
            Kind::Packed { batch, .. } => batch.key_count(),
            Kind::Arrow { batch, .. } => batch.row_ids.len(),
        }
    }

    /// True for rows of an Arrow dataset (Parquet): read them with `ipc()` or `ArrowReader`, not
    /// `to_dict()`.
    #[getter]
    fn arrow(&self) -> bool {
        matches!(self.kind, Kind::Arrow { .. })
    }

    /// The batches of the stream an Arrow message carries, as `(index, rows)` in row order (the
    /// record batch's first `rows` rows are the first batch's, and so on); one for a message of
    /// one batch. The stream's receive task checked them already (`arrow_parts`); other batches
    /// are one batch each and have no parts.
    fn parts(&self) -> PyResult<Vec<(u64, u32)>> {
        match &self.kind {
            Kind::Arrow { batch, .. } => {
                shardstream_client::arrow_parts(batch, u32::MAX).map_err(crate::errors::to_pyerr)
            }
            _ => Err(ShardstreamError::new_err("parts() is for Arrow batches (Parquet datasets)")),
        }
    }

    /// The rows' sample ids (global row numbers) of an Arrow batch as little-endian `u64`s, for
    /// `numpy.frombuffer(..., "<u8")`: one copy of 8 bytes a row (a list of Python ints cost
    /// ~35x more per batch); empty for other batches.
    fn row_id_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        match &self.kind {
            Kind::Arrow { batch, .. } => PyBytes::new_with(py, batch.row_ids.len() * 8, |out| {
                for (chunk, id) in out.chunks_exact_mut(8).zip(&batch.row_ids) {
                    chunk.copy_from_slice(&id.to_le_bytes());
                }
                Ok(())
            }),
            _ => Ok(PyBytes::new(py, b"")),
        }
    }

    /// An Arrow batch's IPC stream (a schema message, then one record batch) as a read-only
    /// buffer object: over the ring slot with shared memory (checked against the slot's bounds
    /// first; it holds the batch's lease until it and every view of it are gone), over the
    /// received message inline.
    fn ipc<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        crate::errors::no_panic("Batch.ipc", || match &self.kind {
            Kind::Arrow { data, shm: None, .. } => {
                Ok(Bound::new(py, Buffer { data: data.clone(), _lease: None })?.into_any())
            }
            Kind::Arrow { batch, shm: Some((session, lease)), .. } => {
                let (ring, range) = arrow_slot(batch, session)?;
                let column = Column { ring, slot: batch.slot, range, _lease: lease.clone() };
                Ok(Bound::new(py, column)?.into_any())
            }
            _ => Err(ShardstreamError::new_err("ipc() is for Arrow batches (Parquet datasets); use to_dict()")),
        })
    }

    /// Payload bytes of the batch's fields (for shm batches: once `to_dict` has run; before,
    /// the samples' byte ranges, headers included; for Arrow batches, the IPC stream's length).
    #[getter]
    fn nbytes(&self) -> PyResult<u64> {
        crate::errors::no_panic("Batch.nbytes", || Ok(self.nbytes_unguarded()))
    }

    /// True when the fields are stacked arrays gathered by the daemon (packed mode).
    #[getter]
    fn packed(&self) -> bool {
        matches!(self.kind, Kind::Packed { .. })
    }

    /// Returns the batch's lease (shm): the daemon may then evict its shards. Views already
    /// handed out stay readable (the mapping outlives the lease). For a packed batch the daemon
    /// reuses its ring slot: its arrays must not be used afterwards. No-op for inline batches.
    /// `at_once=False` (the package's own calls, once it has copied out what it needs): the
    /// release may travel with the next few, as when a batch is dropped.
    #[pyo3(signature = (at_once=true))]
    fn release(&self, at_once: bool) -> PyResult<()> {
        crate::errors::no_panic("Batch.release", || {
            let lease = match &self.kind {
                Kind::Shm { lease, .. } | Kind::Packed { lease, .. } => lease,
                Kind::Arrow { shm: Some((_, lease)), .. } => lease,
                Kind::Inline(_) | Kind::Arrow { shm: None, .. } => return Ok(()),
            };
            if at_once {
                lease.release_now()
            } else {
                lease.release()
            }
            Ok(())
        })
    }

    /// Says that the batch's ring slot (a packed or Arrow batch over shared memory) is handed out
    /// as memory that may be written: torch tensors, which torch cannot make read-only. What this
    /// process writes there stays its own (the ring mapping is copy-on-write) and is dropped
    /// before the slot goes back to the daemon. No-op for other batches.
    fn may_be_written(&self) -> PyResult<()> {
        crate::errors::no_panic("Batch.may_be_written", || {
            let (session, lease, ring, slot) = match &self.kind {
                Kind::Packed { batch, session, lease } => (session, lease, batch.ring, batch.slot),
                Kind::Arrow { batch, shm: Some((session, lease)), .. } => (session, lease, batch.ring, batch.slot),
                _ => return Ok(()),
            };
            if lease.written.get().is_none() {
                let mapping = session.ring(ring).map_err(crate::errors::to_pyerr)?;
                session.open_slot(&mapping, ring, slot).map_err(crate::errors::to_pyerr)?;
                // Set already (another thread opened it at the same time): one close serves both.
                let _ = lease.written.set((mapping, ring, slot));
            }
            Ok(())
        })
    }

    /// The batch as a dict. `copy=False`: zero-copy memoryviews; `copy=True`: `bytes` objects
    /// (picklable). Missing fields are None.
    #[pyo3(signature = (copy=false))]
    fn to_dict<'py>(&self, py: Python<'py>, copy: bool) -> PyResult<Bound<'py, PyDict>> {
        crate::errors::no_panic("Batch.to_dict", || {
            match &self.kind {
                Kind::Inline(b) => inline_dict(py, b, copy),
                Kind::Shm { batch, session, lease } => {
                    let (d, payload) = shm_dict(py, batch, session, lease, &self.fields, copy)?;
                    self.payload.store(payload, Ordering::Relaxed);
                    if copy {
                        // Every value is bytes of its own: the credit (and the shards it holds)
                        // can go back now, not when the batch is dropped.
                        lease.release();
                    }
                    Ok(d)
                }
                Kind::Packed { batch, session, lease } => {
                    let (d, payload) = packed_dict(py, batch, session, lease, &self.fields, copy)?;
                    self.payload.store(payload, Ordering::Relaxed);
                    if copy {
                        // Everything was copied out: the slot can go back to the daemon now.
                        lease.release();
                    }
                    Ok(d)
                }
                Kind::Arrow { .. } => Err(ShardstreamError::new_err(
                    "an Arrow batch (Parquet dataset) has no sample dict here: open ipc() with pyarrow \
                     (shardstream.Loader does)",
                )),
            }
        })
    }
}

/// A packed batch as `{"__key__": [str], field: ndarray(samples, record_bytes) of uint8}`.
fn packed_dict<'py>(
    py: Python<'py>,
    b: &PackedBatch,
    session: &ShmSession,
    lease: &Arc<Lease>,
    fields: &[String],
    copy: bool,
) -> PyResult<(Bound<'py, PyDict>, u64)> {
    let ring = session.ring(b.ring).map_err(crate::errors::to_pyerr)?;
    let slot = ring.slot(b.slot).ok_or_else(|| {
        ShardstreamError::new_err(format!("packed batch names slot {} of a ring of {}", b.slot, ring.header.slot_count))
    })?;
    let view = shardstream_proto::ring::read_slot(slot, b.slot, b.batch_index, fields.len())
        .map_err(|e| ShardstreamError::new_err(format!("packed batch {}: {e}", b.batch_index)))?;
    let keys = b.key_strs().map_err(|e| ShardstreamError::new_err(format!("packed batch {}: {e}", b.batch_index)))?;
    if view.header.n_samples != keys.len() as u64 {
        return Err(ShardstreamError::new_err(format!(
            "packed batch {}: slot holds {} samples, the message names {}",
            b.batch_index,
            view.header.n_samples,
            keys.len()
        )));
    }
    let numpy = py.import("numpy")?;
    let (frombuffer, uint8) = (numpy.getattr("frombuffer")?, numpy.getattr("uint8")?);
    let d = PyDict::new(py);
    d.set_item("__key__", PyList::new(py, keys)?)?;
    for (name, desc) in fields.iter().zip(&view.fields) {
        // read_slot checked that the column lies inside the slot, so these fit in usize.
        let range = desc.column().unwrap_or_default();
        let range = usize::try_from(range.start).unwrap_or(0)..usize::try_from(range.end).unwrap_or(0);
        let column = Bound::new(py, Column { ring: ring.clone(), slot: b.slot, range, _lease: lease.clone() })?;
        let flat = frombuffer.call1((column, &uint8))?;
        let mut array = flat.call_method1("reshape", (desc.count, desc.record_bytes))?;
        if copy {
            array = array.call_method0("copy")?;
        }
        d.set_item(name, array)?;
    }
    Ok((d, view.header.payload_bytes))
}

/// Most bytes of read buffers kept for reuse (process-wide).
const READ_POOL_BYTES: usize = 64 << 20;

static READ_POOL: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// The buffer a batch's samples of shards that are read (not mapped) are read into, taken from a
/// process-wide pool and given back when the batch's last view of it is gone. A fresh buffer of
/// a batch's size (MiBs) per batch was zero-filled or faulted in page by page before the reads
/// overwrote it: a cost of the order of the reads themselves (bench/PROFILES.md, view mode).
#[derive(Default)]
struct ReadBuffer {
    buf: Vec<u8>,
    /// Bytes in use (the rest of `buf` is initialised, left from an earlier batch).
    len: usize,
}

impl ReadBuffer {
    /// A buffer of `len` bytes, whose contents are left from an earlier batch: every byte is to
    /// be overwritten by the reads.
    fn take(len: usize) -> Self {
        let mut pool = READ_POOL.lock().unwrap_or_else(|p| p.into_inner());
        // The smallest pooled buffer that fits, else the largest (it grows once).
        let fits = pool.iter().enumerate().filter(|(_, b)| b.len() >= len).min_by_key(|(_, b)| b.len()).map(|(i, _)| i);
        let pick = fits.or_else(|| pool.iter().enumerate().max_by_key(|(_, b)| b.len()).map(|(i, _)| i));
        let mut buf = pick.map(|i| pool.swap_remove(i)).unwrap_or_default();
        drop(pool);
        if buf.len() < len {
            buf.resize(len, 0);
        }
        Self { buf, len }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl AsRef<[u8]> for ReadBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for ReadBuffer {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if buf.is_empty() {
            return;
        }
        let mut pool = READ_POOL.lock().unwrap_or_else(|p| p.into_inner());
        let held: usize = pool.iter().map(Vec::len).sum();
        if held + buf.len() <= READ_POOL_BYTES {
            pool.push(buf);
        }
    }
}

fn shm_dict<'py>(
    py: Python<'py>,
    b: &ShmBatch,
    session: &ShmSession,
    lease: &Arc<Lease>,
    fields: &[String],
    copy: bool,
) -> PyResult<(Bound<'py, PyDict>, u64)> {
    let n = b.slots.len();
    let mut payload = 0u64;
    if b.starts.len() != n || b.lengths.len() != n {
        return Err(ShardstreamError::new_err("malformed shm batch: columns of different lengths"));
    }
    // (slot, mapping, memoryview over its region): batches draw on a few shards, so a short list.
    let mut regions: Vec<(u32, Arc<Mapping>, Option<Bound<'py, PyAny>>)> = Vec::new();
    // Where each sample's bytes are: (its shard's region, start, whether `start` is in `copied`,
    // the batch's samples of shards that are read rather than mapped, or in the mapping).
    let mut located: Vec<(usize, usize, bool)> = Vec::with_capacity(n);
    let mut copied = ReadBuffer::default();
    let mut copy_len = 0usize;
    // (region, sample, offset in `copied`) of the samples to read.
    let mut to_read: Vec<(usize, usize, usize)> = Vec::new();
    for i in 0..n {
        let slot = b.slots[i];
        let at = match regions.iter().position(|r| r.0 == slot) {
            Some(at) => at,
            None => {
                let map = session.mapping(slot).map_err(crate::errors::to_pyerr)?;
                let view = if copy || !map.is_mapped() {
                    None
                } else {
                    let region = Bound::new(py, Region { map: map.clone(), _lease: Some(lease.clone()) })?;
                    Some(PyMemoryView::from(&region.into_any())?.into_any())
                };
                regions.push((slot, map, view));
                regions.len() - 1
            }
        };
        let map = &regions[at].1;
        let len = usize::try_from(b.lengths[i]).unwrap_or(usize::MAX);
        if map.is_mapped() {
            let start = usize::try_from(b.starts[i]).unwrap_or(usize::MAX);
            if start.checked_add(len).is_none_or(|end| end > map.bytes().len()) {
                return Err(ShardstreamError::new_err(format!(
                    "shm descriptor outside its shard: {}, bytes {}..+{} of {}",
                    map.name,
                    b.starts[i],
                    b.lengths[i],
                    map.bytes().len()
                )));
            }
            located.push((at, start, false));
        } else {
            // A shard read in place (it may be truncated by others at any time): its samples
            // are read into memory this batch owns, never mapped.
            let at_copy = copy_len;
            copy_len = at_copy.checked_add(len).filter(|&e| e <= isize::MAX as usize).ok_or_else(|| {
                ShardstreamError::new_err(format!("shm descriptor of {} bytes in {}", b.lengths[i], map.name))
            })?;
            to_read.push((at, i, at_copy));
            located.push((at, at_copy, true));
        }
    }
    if copy_len > 0 {
        // One allocation (zeroed pages straight from the kernel) and the reads without the GIL.
        copied = ReadBuffer::take(copy_len);
        let reads: Vec<(&Mapping, &mut [u8], u64)> = {
            let mut rest = copied.as_mut_slice();
            let mut out = Vec::with_capacity(to_read.len());
            for &(at, i, _) in &to_read {
                let len = usize::try_from(b.lengths[i]).unwrap_or(usize::MAX);
                let (buf, tail) = rest.split_at_mut(len.min(rest.len()));
                rest = tail;
                out.push((&*regions[at].1, buf, b.starts[i]));
            }
            out
        };
        // The shards read here, checked after their reads: one rewritten in place meanwhile is
        // a ShardError, not other samples at the daemon's offsets.
        let read: Vec<&Mapping> = regions.iter().map(|r| &*r.1).filter(|m| !m.is_mapped()).collect();
        py.detach(|| {
            reads.into_iter().try_for_each(|(map, buf, offset)| map.read_at(buf, offset))?;
            read.into_iter().try_for_each(Mapping::check_unchanged)
        })
        .map_err(crate::errors::to_pyerr)?;
    }
    let copied = if copied.len == 0 { Bytes::new() } else { Bytes::from_owner(copied) };
    let copied_view = if copy || copied.is_empty() {
        None
    } else {
        let owner = Bound::new(py, Buffer { data: copied.clone(), _lease: Some(lease.clone()) })?;
        Some(PyMemoryView::from(&owner.into_any())?.into_any())
    };
    let mut keys: Vec<Bound<'py, PyAny>> = Vec::with_capacity(n);
    let mut columns: Vec<Vec<Bound<'py, PyAny>>> = fields.iter().map(|_| Vec::with_capacity(n)).collect();
    // The daemon located every key and field from its index (`ShmBatch.key_offsets`, `fields`):
    // slice, parse nothing. Otherwise (a shard without a layout) parse each sample's headers.
    let given = given_locations(b, fields);
    // One item: bytes `a..z` of `all` as a view (or a copy), counted as payload.
    let item = |all: &[u8], view: Option<&Bound<'py, PyAny>>, a: usize, z: usize| -> PyResult<Bound<'py, PyAny>> {
        Ok(match view {
            None => PyBytes::new(py, &all[a..z]).into_any(),
            Some(mv) => mv.get_item(slice(py, a, z)?)?,
        })
    };
    for (i, &(at, start, in_copy)) in located.iter().enumerate() {
        if given.is_some()
            && let Some(&(ahead_at, ahead_start, false)) = located.get(i + KEY_PREFETCH_AHEAD)
            && let Some(&key_at) = b.key_offsets.get(i + KEY_PREFETCH_AHEAD)
        {
            regions[ahead_at].1.prefetch(ahead_start.saturating_add(usize::try_from(key_at).unwrap_or(usize::MAX)));
        }
        let (_, map, view) = &regions[at];
        let name = map.name.as_str();
        let (all, view) = if in_copy { (&copied[..], copied_view.as_ref()) } else { (map.bytes(), view.as_ref()) };
        // Both ranges were checked above (mapped) or made to fit (copied).
        let len = usize::try_from(b.lengths[i]).unwrap_or(usize::MAX);
        let bytes = all.get(start..start.saturating_add(len)).unwrap_or_default();
        if let Some(cols) = given
            && let Some(key) = given_key(b, i, bytes)
        {
            keys.push(PyString::new(py, key).into_any());
            for (col, c) in columns.iter_mut().zip(cols) {
                let found = if c.missing.binary_search(&(i as u32)).is_ok() {
                    None
                } else {
                    let (s, l) = (c.starts[i], c.lengths[i]);
                    let end = s.checked_add(l).filter(|&e| e <= bytes.len() as u64).ok_or_else(|| {
                        ShardstreamError::new_err(format!(
                            "malformed shm batch: field {:?} of sample {i} lies outside it ({s}..+{l} of {})",
                            c.name,
                            bytes.len()
                        ))
                    })?;
                    Some((start + s as usize, start + end as usize))
                };
                col.push(match found {
                    None => py.None().into_bound(py),
                    Some((a, z)) => {
                        payload += (z - a) as u64;
                        item(all, view, a, z)?
                    }
                });
            }
            continue;
        }
        let sample = shardstream::format::tar::parse_sample(bytes).map_err(|e| {
            let e = e.with_base(b.starts[i]);
            crate::errors::shard_error(format!("shard {name}: {e}"), name, e.offset())
        })?;
        keys.push(PyString::new(py, &sample.key).into_any());
        for (col, field) in columns.iter_mut().zip(fields) {
            let found = match sample.members.iter().find(|m| m.field == field.as_str()) {
                None => py.None().into_bound(py),
                Some(m) => {
                    let (a, z) = (start + m.data.start, start + m.data.end);
                    payload += (z - a) as u64;
                    item(all, view, a, z)?
                }
            };
            col.push(found);
        }
    }
    let d = PyDict::new(py);
    d.set_item("__key__", PyList::new(py, keys)?)?;
    for (name, col) in fields.iter().zip(columns) {
        d.set_item(name, PyList::new(py, col)?)?;
    }
    Ok((d, payload))
}

/// Samples ahead of the one being turned into Python objects whose key is prefetched: in a
/// shuffled batch each sample's header lies on pages of its own, and reading its key was the
/// largest cost of an epoch after populating the mappings (a miss to memory, not UTF-8 work).
const KEY_PREFETCH_AHEAD: usize = 6;

/// The batch's field columns when the daemon sent complete ones for exactly the stream's fields
/// (one entry per sample each), else None (the samples are then parsed).
fn given_locations<'b>(b: &'b ShmBatch, fields: &[String]) -> Option<&'b [FieldColumn]> {
    let n = b.slots.len();
    let complete = b.key_offsets.len() == n
        && b.key_lengths.len() == n
        && b.fields.len() == fields.len()
        && b.fields.iter().zip(fields).all(|(c, f)| c.name == *f && c.starts.len() == n && c.lengths.len() == n);
    complete.then_some(&b.fields[..])
}

/// Sample `i`'s key as the daemon located it in `bytes` (the sample), if it lies there and is
/// UTF-8; None makes the caller parse the sample (which then says what is wrong).
fn given_key<'a>(b: &ShmBatch, i: usize, bytes: &'a [u8]) -> Option<&'a str> {
    let at = usize::try_from(b.key_offsets[i]).ok()?;
    let len = usize::try_from(b.key_lengths[i]).ok()?;
    std::str::from_utf8(bytes.get(at..at.checked_add(len)?)?).ok()
}

fn inline_dict<'py>(py: Python<'py>, b: &InlineBatch, copy: bool) -> PyResult<Bound<'py, PyDict>> {
    let n = b.keys.len();
    let d = PyDict::new(py);
    d.set_item("__key__", PyList::new(py, &b.keys)?)?;
    let view = if copy {
        None
    } else {
        let owner = Bound::new(py, Buffer { data: b.data.clone(), _lease: None })?;
        Some(PyMemoryView::from(&owner.into_any())?)
    };
    for col in &b.fields {
        let mut items: Vec<Bound<'py, PyAny>> = Vec::with_capacity(n);
        let mut missing = col.missing.iter().peekable();
        for i in 0..n {
            if missing.peek().is_some_and(|&&m| m as usize == i) {
                missing.next();
                items.push(py.None().into_bound(py));
                continue;
            }
            let (start, len) = match (col.starts.get(i), col.lengths.get(i)) {
                (Some(&s), Some(&l)) => (s as usize, l as usize),
                _ => return Err(ShardstreamError::new_err("malformed batch: short column")),
            };
            let end = start
                .checked_add(len)
                .filter(|&e| e <= b.data.len())
                .ok_or_else(|| ShardstreamError::new_err("malformed batch: field outside the batch buffer"))?;
            let item = match &view {
                None => PyBytes::new(py, &b.data[start..end]).into_any(),
                Some(mv) => mv.get_item(slice(py, start, end)?)?,
            };
            items.push(item);
        }
        d.set_item(&col.name, PyList::new(py, items)?)?;
    }
    Ok(d)
}

/// `slice(a, z)`, to cut a field's view from its batch's memoryview. Not pyo3's `PySlice::new`
/// (0.30): it passes `PySlice_New` ints it makes and never releases, and `PySlice_New` takes
/// references of its own, so two ints leaked per field of every sample (80 MB an epoch of
/// ImageNet).
fn slice(py: Python<'_>, a: usize, z: usize) -> PyResult<Bound<'_, PyAny>> {
    let (start, stop) = (a.into_pyobject(py)?, z.into_pyobject(py)?);
    // SAFETY: `start` and `stop` are live ints for the whole call, which takes references of
    // its own to what it keeps and none of ours; a null step is `None`. It returns a new
    // reference, or null with an exception set, which `from_owned_ptr_or_err` turns into the
    // error.
    unsafe {
        Bound::from_owned_ptr_or_err(py, pyo3::ffi::PySlice_New(start.as_ptr(), stop.as_ptr(), std::ptr::null_mut()))
    }
}
