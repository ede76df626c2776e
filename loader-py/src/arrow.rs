//! Arrow batches (Parquet datasets) handed to pyarrow without a copy.
//!
//! [`ArrowReader`] opens each batch of a stream with views (`binary_views`) in Rust
//! ([`shardstream_client::arrow`]: the IPC stream decoded over the ring slot or the received
//! message, view columns rebuilt over the mapped row groups) and returns an [`ArrowBatch`], which
//! pyarrow imports through the Arrow C data interface: its schema once per stream schema
//! (`__arrow_c_schema__`), its arrays with every batch (`export_array`). Every buffer pyarrow
//! sees is the one in shared memory; the exported arrays hold, through arrow's own reference
//! counts, the slot's lease and the mappings until pyarrow releases the last of them.
//!
//! Rebuilding the views with pyarrow in Python cost 60-90 us a batch of the consumer's core
//! (bench/PARQUET_PROFILE.md); batches without views are read with pyarrow's own IPC reader.

use std::sync::Arc;

use arrow_array::ffi::{FFI_ArrowArray, FFI_ArrowSchema};
use arrow_array::{Array, RecordBatch, StructArray};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::batch::Batch;
use crate::errors::ShardstreamError;

/// Opens the Arrow batches of one stream (it keeps the stream's schema message).
#[pyclass(module = "shardstream._native")]
pub struct ArrowReader {
    inner: shardstream_client::arrow::ArrowReader,
    has_row: bool,
    /// Bumped whenever a batch's schema differs from the one before.
    schema_generation: u64,
    last_schema: Option<arrow_schema::SchemaRef>,
}

#[pymethods]
impl ArrowReader {
    #[new]
    fn new() -> Self {
        Self {
            inner: shardstream_client::arrow::ArrowReader::new(),
            has_row: false,
            schema_generation: 0,
            last_schema: None,
        }
    }

    /// `batch` (an Arrow batch) as an object for `pyarrow.record_batch`. Errors name the batch:
    /// bytes that are no IPC stream, a row count other than the message's, a view outside its
    /// segment.
    fn open(&mut self, batch: &Batch) -> PyResult<ArrowBatch> {
        crate::errors::no_panic("ArrowReader.open", || {
            let bytes = batch.arrow_bytes()?;
            let opened = self
                .inner
                .open(&bytes.ipc, &bytes.views, bytes.rows)
                .map_err(|e| ShardstreamError::new_err(format!("arrow batch {}: {e}", bytes.index)))?;
            self.has_row = opened.has_row;
            let schema = opened.batch.schema();
            // The reader hands out the one `Arc` it keeps while a stream's schema is unchanged.
            if !self.last_schema.as_ref().is_some_and(|s| Arc::ptr_eq(s, &schema) || **s == *schema) {
                self.schema_generation += 1;
                self.last_schema = Some(schema);
            }
            Ok(ArrowBatch { batch: opened.batch })
        })
    }

    /// Whether the batch `open` returned last has the daemon's `__row__` column (an older daemon
    /// wrote none; the package appends the ids then).
    #[getter]
    fn has_row(&self) -> bool {
        self.has_row
    }

    /// Changes whenever the batch `open` returned last has another schema than the one before
    /// it: a caller may import the schema once per generation (`ArrowBatch.__arrow_c_schema__`)
    /// and each batch's arrays alone (`ArrowBatch.export_array`).
    #[getter]
    fn schema_generation(&self) -> u64 {
        self.schema_generation
    }
}

/// One opened record batch, exported through the Arrow C data interface.
#[pyclass(module = "shardstream._native", frozen)]
pub struct ArrowBatch {
    batch: RecordBatch,
}

#[pymethods]
impl ArrowBatch {
    /// The batch's schema (the Arrow PyCapsule interface), its metadata on the struct it
    /// describes: `pyarrow.schema(batch)` imports it.
    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        crate::errors::no_panic("ArrowBatch.__arrow_c_schema__", || {
            let schema = FFI_ArrowSchema::try_from(self.batch.schema().as_ref())
                .map_err(|e| ShardstreamError::new_err(format!("exporting an arrow schema: {e}")))?;
            PyCapsule::new_with_value(py, schema, c"arrow_schema")
        })
    }

    /// The batch's arrays alone, for `pyarrow.RecordBatch._import_from_c(address, schema)` with
    /// a schema imported once: exporting and importing the schema with every batch was a cost of
    /// its own (bench/PARQUET_PROFILE.md, "batches with views opened in native code"). Returns a
    /// capsule that owns the exported `ArrowArray` struct and the struct's address; pyarrow moves
    /// the struct out (its release callback then belongs to pyarrow), and the capsule frees what
    /// is left when it goes.
    fn export_array<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyCapsule>, usize)> {
        crate::errors::no_panic("ArrowBatch.export_array", || {
            let data = StructArray::from(self.batch.clone()).into_data();
            let capsule = PyCapsule::new_with_value(py, FFI_ArrowArray::new(&data), c"arrow_array")?;
            let address = capsule.pointer_checked(Some(c"arrow_array"))?.as_ptr() as usize;
            Ok((capsule, address))
        })
    }
}
