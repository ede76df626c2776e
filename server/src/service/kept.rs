//! The node cache as the place a stream keeps its decoded row groups (see
//! `format::parquet::kept`): one derived entry per (file, row group, projection).

use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use arrow_array::RecordBatch;

use crate::cache::NodeCache;
use crate::format::parquet::ParquetError;
use crate::format::parquet::kept::{self, Done, KeptRowGroups};
use crate::index::Dataset;

/// The derived entries of one dataset and assembler projection (clones share everything).
#[derive(Debug, Clone)]
pub struct NodeKept {
    cache: Arc<NodeCache>,
    ds: Arc<Dataset>,
    projection: u64,
    /// Set by the first fill that failed (a full or failing disk): the stream keeps nothing more,
    /// rather than failing (and logging) once per row group.
    failed: Arc<AtomicBool>,
}

impl NodeKept {
    pub fn new(cache: Arc<NodeCache>, ds: Arc<Dataset>, projection: u64) -> Self {
        Self { cache, ds, projection, failed: Arc::new(AtomicBool::new(false)) }
    }

    fn key(&self, file: usize, rg: usize) -> String {
        self.ds.decoded_key(file, self.projection, rg)
    }
}

fn io(what: &str, e: impl std::fmt::Display) -> ParquetError {
    ParquetError::Io(format!("kept row group: {what}: {e}"))
}

impl KeptRowGroups for NodeKept {
    fn open(&self, file: usize, rg: usize) -> Option<File> {
        let pin = self.cache.derived(&self.key(file, rg))?;
        // Opened under the pin; once open, eviction (an unlink) no longer matters to its reader.
        match File::open(pin.path()) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(path = %pin.path().display(), error = %e, "cannot open a kept row group");
                None
            }
        }
    }

    fn keep(
        &self,
        file: usize,
        rg: usize,
        bytes: u64,
        write: &mut dyn FnMut(&File) -> Result<(), ParquetError>,
    ) -> Result<Option<File>, ParquetError> {
        if self.failed.load(Relaxed) {
            return Ok(None);
        }
        let key = self.key(file, rg);
        let pin = self
            .cache
            .fill_derived(&key, bytes, &mut |path, f| {
                write(f).map_err(|e| crate::Error::Unavailable(format!("{}: {e}", path.display())))
            })
            .map_err(|e| {
                self.failed.store(true, Relaxed);
                io("cannot keep it (this stream keeps no more)", e)
            })?;
        let Some(pin) = pin else { return Ok(None) };
        File::open(pin.path()).map(Some).map_err(|e| io(&format!("cannot open {}", pin.path().display()), e))
    }

    fn discard(&self, file: usize, rg: usize) {
        self.cache.remove_derived(&self.key(file, rg));
    }

    /// On the daemon's background writer (`super::kept_writer`).
    fn keep_later(&self, file: usize, rg: usize, name: &str, batch: Arc<RecordBatch>, done: Done) -> bool {
        if self.failed.load(Relaxed) {
            done(None);
            return true;
        }
        let Some(writer) = super::kept_writer::shared() else {
            done(None);
            return true;
        };
        let (this, name) = (self.clone(), name.to_owned());
        let bytes = crate::format::parquet::decoded::held_bytes(&batch);
        writer.submit(
            bytes,
            Box::new(move || {
                let opened = kept::keep_now(&this, file, rg, &name, &batch);
                drop(batch);
                done(opened);
            }),
        )
    }
}
