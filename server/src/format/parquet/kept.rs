//! Decoded row groups kept on the node's disk, so that later epochs and a daemon started later
//! (the next job's sidecar, a restart after an upgrade) serve them without decoding again.
//!
//! A stream with `binary_views` copies each decoded row group's binary values once, into an
//! arena its clients map ([`super::arena`]). Where the daemon has a node cache, that arena is a
//! file there instead of a memfd: the row group as decoded, written as an Arrow IPC file.
//!
//! A stream without views keeps a row group only when it decodes it a second time: the decoded
//! budget let go of it, so the projection's working set does not fit in memory and every epoch
//! would decode it again. Keeping it from the first decode would cost every run the writing,
//! also a single-epoch run that never reads it again; keeping it from the second costs one more
//! decode where a run has several epochs. Only projections decoded as views (every column flat)
//! are kept this way; what such a stream gathers from a kept file is the same as from memory.
//!
//! The
//! file is a derived node-cache entry (`cache` module docs: published without an fsync, trusted
//! by the next start only after a clean shutdown), keyed by the Parquet file's identity, the row
//! group and the stream's projection, so a changed file or other columns never reuse it.
//!
//! Loading maps the file, decodes the IPC message without copying (every buffer is 64-byte
//! aligned in a page-aligned mapping; one that is not is an error, never a silent copy), and
//! rebases every binary view onto the whole mapping, which becomes the row group's arena: the
//! views a batch carries point into the file the client maps. Nothing in the file is trusted:
//! the IPC decoder validates every array, every view is checked against the mapping, and the
//! columns must be the projection's. A file that fails is an error the caller answers by decoding
//! the row group again.

use arrow_array::{Array, RecordBatch};
use arrow_buffer::Buffer;
use arrow_ipc::reader::FileDecoder;
use arrow_ipc::writer::FileWriter;
use arrow_schema::SchemaRef;
use std::fs::File;
use std::io::Write;
use std::sync::Arc;

use super::ParquetError;
use super::arena::{self, Arena};

/// Where a stream keeps its decoded row groups: the node cache's derived entries for its
/// dataset and projection.
pub trait KeptRowGroups: Send + Sync + std::fmt::Debug {
    /// The kept row group `rg` of the dataset's file `file`, opened for reading, if there is one.
    fn open(&self, file: usize, rg: usize) -> Option<File>;

    /// Keeps row group `rg` of file `file`: `write` writes it (at most `bytes`) into the file it
    /// is given. The kept file opened for reading, or None when there is no room for it.
    fn keep(
        &self,
        file: usize,
        rg: usize,
        bytes: u64,
        write: &mut dyn FnMut(&File) -> Result<(), ParquetError>,
    ) -> Result<Option<File>, ParquetError>;

    /// Drops a kept row group that did not load (damaged on disk).
    fn discard(&self, file: usize, rg: usize);

    /// Keeps row group `rg` of file `file`, decoded as `batch`, when convenient (a stream
    /// without views serves it from memory meanwhile), then calls `done` with the kept file
    /// opened for reading, or None (no room, or the disk failed). False, with `done` dropped
    /// uncalled, when it cannot be taken now: the caller may try again later. This default
    /// keeps it at once, in the caller.
    /// `name` is the file's, for what is logged.
    fn keep_later(&self, file: usize, rg: usize, name: &str, batch: Arc<RecordBatch>, done: Done) -> bool {
        done(keep_now(self, file, rg, name, &batch));
        true
    }
}

/// What [`KeptRowGroups::keep_later`] calls once it has kept a row group, or failed to.
pub type Done = Box<dyn FnOnce(Option<File>) + Send>;

/// `batch` (row group `rg` of file `file`, named `name`) kept by `kept` now: the kept file, or
/// None (no room; a failure is logged).
pub fn keep_now<K: KeptRowGroups + ?Sized>(
    kept: &K,
    file: usize,
    rg: usize,
    name: &str,
    batch: &RecordBatch,
) -> Option<File> {
    match kept.keep(file, rg, bound(batch), &mut |f| write(batch, f)) {
        Ok(opened) => opened,
        Err(e) => {
            tracing::warn!(file = %name, row_group = rg, error = %e, "cannot keep a decoded row group on disk");
            None
        }
    }
}

/// [`load`] of row group `rg` of file `file` (named `name`) from `opened`, with the kept file's
/// device and inode (what the decoded cache lets go of when the node cache evicts it); one that
/// does not load (damaged) is logged and discarded from `kept`, and the caller decodes the row
/// group instead.
pub fn load_or_discard<K: KeptRowGroups + ?Sized>(
    kept: &K,
    file: usize,
    rg: usize,
    name: &str,
    opened: File,
    schema: &SchemaRef,
    rows: usize,
) -> Option<(RecordBatch, (u64, u64))> {
    use std::os::unix::fs::MetadataExt;
    let identity = opened.metadata().map(|m| (m.dev(), m.ino())).map_err(|e| ipc("stat", e));
    match identity.and_then(|id| load(opened, name, schema, rows).map(|b| (b, id))) {
        Ok(loaded) => Some(loaded),
        Err(e) => {
            tracing::warn!(file = %name, row_group = rg, error = %e, "a kept row group did not load; deleted, decoded instead");
            kept.discard(file, rg);
            None
        }
    }
}

/// Writes below this size go through a buffer; larger ones (the binary columns' data buffers)
/// straight to the file, in one `write` each, so nothing is copied twice. One large write also
/// leaves the file in 2 MiB page-cache folios, which the readers of every later epoch map with
/// one entry each; a MiB a write would leave small ones (bench/PARQUET_PROFILE.md, "folio
/// sizes").
const WRITE_BUFFER: usize = 64 << 10;

/// Upper bound of the bytes [`write`] makes of `batch`: its buffers' capacities, padding and
/// the IPC metadata.
pub fn bound(batch: &RecordBatch) -> u64 {
    batch.get_array_memory_size() as u64 + (1 << 20)
}

fn ipc(what: &str, e: impl std::fmt::Display) -> ParquetError {
    ParquetError::Ipc(format!("kept row group: cannot {what}: {e}"))
}

/// Writes `batch` (a decoded row group, binary columns as views) into `file` as an Arrow IPC
/// file.
pub fn write(batch: &RecordBatch, file: &File) -> Result<(), ParquetError> {
    let out = std::io::BufWriter::with_capacity(WRITE_BUFFER, file);
    let mut w = FileWriter::try_new(out, &batch.schema()).map_err(|e| ipc("write", e))?;
    w.write(batch).map_err(|e| ipc("write", e))?;
    w.finish().map_err(|e| ipc("write", e))?;
    w.into_inner().map_err(|e| ipc("write", e))?.flush().map_err(|e| ipc("write", e))
}

/// The row group kept in `file` by [`write`], over its mapping (which becomes the row group's
/// arena), with the columns of `schema` and `rows` rows.
pub fn load(file: File, name: &str, schema: &SchemaRef, rows: usize) -> Result<RecordBatch, ParquetError> {
    // SAFETY: a read-only mapping of a node-cache file opened read-only: the daemon publishes
    // such a file whole (renamed into place) and never writes or truncates it afterwards;
    // eviction only unlinks it, which leaves a mapping valid.
    let map = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(|e| ipc("map", e))?;
    if map.is_empty() {
        return Err(ipc("load", "the file is empty"));
    }
    let arena = Arena::register(file, map, name, false);
    let whole = arena.buffer()?;
    // The IPC decoder slices its input without checking every bound: a damaged file is an
    // error here, never a panic.
    let batch = super::no_panic(|| decode(&whole, schema), |msg| ipc("decode", msg))?;
    if batch.num_rows() != rows {
        return Err(ipc("load", format!("{} rows where the row group has {rows}", batch.num_rows())));
    }
    rebase(&batch, &whole)
}

/// The one record batch of the IPC file `buf`, with `schema`'s columns.
fn decode(buf: &Buffer, schema: &SchemaRef) -> Result<RecordBatch, ParquetError> {
    let bytes = buf.as_slice();
    let Some(trailer_at) = bytes.len().checked_sub(10) else { return Err(ipc("decode", "shorter than a trailer")) };
    let mut trailer = [0u8; 10];
    trailer.copy_from_slice(&bytes[trailer_at..]);
    let footer_len = arrow_ipc::reader::read_footer_length(trailer).map_err(|e| ipc("decode", e))?;
    let footer_at = trailer_at.checked_sub(footer_len).ok_or_else(|| ipc("decode", "footer out of the file"))?;
    let footer = arrow_ipc::root_as_footer(&bytes[footer_at..trailer_at]).map_err(|e| ipc("decode", e))?;
    let stored = footer.schema().ok_or_else(|| ipc("decode", "no schema"))?;
    let stored = arrow_ipc::convert::try_fb_to_schema(stored).map_err(|e| ipc("decode", e))?;
    let same = stored.fields().len() == schema.fields().len()
        && stored
            .fields()
            .iter()
            .zip(schema.fields())
            .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
    if !same {
        return Err(ipc("decode", "its columns are not the projection's"));
    }
    if footer.dictionaries().is_some_and(|d| !d.is_empty()) {
        return Err(ipc("decode", "dictionary-encoded columns are not kept"));
    }
    let decoder = FileDecoder::new(schema.clone(), footer.version()).with_require_alignment(true);
    let blocks = footer.recordBatches().ok_or_else(|| ipc("decode", "no record batch"))?;
    if blocks.len() != 1 {
        return Err(ipc("decode", format!("{} record batches, not one", blocks.len())));
    }
    let block = blocks.get(0);
    let start = usize::try_from(block.offset()).map_err(|_| ipc("decode", "negative offset"))?;
    let len = usize::try_from(block.bodyLength())
        .ok()
        .zip(usize::try_from(block.metaDataLength()).ok())
        .and_then(|(body, meta)| body.checked_add(meta))
        .ok_or_else(|| ipc("decode", "bad block length"))?;
    if start.checked_add(len).is_none_or(|end| end > footer_at) {
        return Err(ipc("decode", "record batch out of the file"));
    }
    decoder
        .read_record_batch(block, &buf.slice_with_length(start, len))
        .map_err(|e| ipc("decode", e))?
        .ok_or_else(|| ipc("decode", "an empty message"))
}

/// `batch` (decoded over `whole`, the arena's mapping) with each binary view pointing into
/// `whole` itself, the one data buffer the session sends for the row group.
fn rebase(batch: &RecordBatch, whole: &Buffer) -> Result<RecordBatch, ParquetError> {
    let base = whole.as_ptr() as usize;
    let end = base + whole.len();
    let arrays = arena::all_view_arrays(batch);
    let mut views = Vec::with_capacity(arrays.len());
    for a in &arrays {
        let buffers = a.data_buffers();
        // Where each of the array's data buffers starts in the mapping: the decoder made them
        // slices of it (alignment was required, so nothing was copied).
        let starts = buffers
            .iter()
            .map(|b| {
                let at = b.as_ptr() as usize;
                if at < base || at + b.len() > end {
                    return Err(ipc("load", "a data buffer is not in the file's mapping"));
                }
                u32::try_from(at - base).map_err(|_| ipc("load", "a row group over 4 GiB"))
            })
            .collect::<Result<Vec<u32>, _>>()?;
        let mut out = Vec::with_capacity(a.len());
        for &v in a.views().iter() {
            let len = v as u32;
            if len <= arena::INLINE {
                out.push(v);
                continue;
            }
            let (index, offset) = ((v >> 64) as u32, (v >> 96) as u32);
            // The decoder validated each view against its own buffer.
            let start = starts.get(index as usize).ok_or_else(|| ipc("load", "a view names no buffer"))?;
            let at = start.checked_add(offset).ok_or_else(|| ipc("load", "a view past 4 GiB"))?;
            out.push((v & u128::from(u64::MAX)) | (u128::from(at) << 96));
        }
        views.push(out);
    }
    // `try_new` checks every rebased view against the mapping again.
    arena::with_views_over(batch, &arrays, views, whole)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use arrow_array::cast::AsArray;
    use arrow_array::{ArrayRef, BinaryViewArray, Int64Array, StringViewArray, StructArray};
    use arrow_schema::{DataType, Field, Schema};

    fn row_group() -> RecordBatch {
        let long: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; 100 + usize::from(i) * 37]).collect();
        let images: Vec<Option<&[u8]>> = long
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if i % 7 == 3 {
                    None
                } else if i % 5 == 1 {
                    Some(&v[..9])
                } else {
                    Some(&v[..])
                }
            })
            .collect();
        // Two data buffers, as a decoder that read two pages makes.
        let (a, b) = images.split_at(17);
        let (a, b) = (BinaryViewArray::from_iter(a.iter().copied()), BinaryViewArray::from_iter(b.iter().copied()));
        let image = arrow_select::concat::concat(&[&a, &b]).unwrap();
        let bytes: ArrayRef = Arc::new(BinaryViewArray::from_iter_values((0..40).map(|i| vec![b'x'; 20 + i])));
        let path: ArrayRef = Arc::new(StringViewArray::from_iter_values((0..40).map(|i| format!("dir/{i}.jpg"))));
        let fields: arrow_schema::Fields =
            vec![Field::new("bytes", DataType::BinaryView, true), Field::new("path", DataType::Utf8View, true)].into();
        let hf = StructArray::new(fields.clone(), vec![bytes, path], None);
        let schema = Arc::new(Schema::new(vec![
            Field::new("image", DataType::BinaryView, true),
            Field::new("label", DataType::Int64, false),
            Field::new("hf", DataType::Struct(fields), true),
        ]));
        RecordBatch::try_new(schema, vec![image, Arc::new(Int64Array::from_iter_values(0..40)), Arc::new(hf)]).unwrap()
    }

    fn kept(batch: &RecordBatch) -> (tempfile::NamedTempFile, File) {
        let f = tempfile::NamedTempFile::new().unwrap();
        write(batch, f.as_file()).unwrap();
        let read = File::open(f.path()).unwrap();
        (f, read)
    }

    #[test]
    fn a_kept_row_group_loads_equal_with_its_views_over_the_file() {
        let before = row_group();
        let (_f, file) = kept(&before);
        let after = load(file, "t", &before.schema(), 40).unwrap();
        assert_eq!(after, before, "the same values, nulls and columns");
        let image = after.column(0).as_binary_view();
        assert_eq!(image.data_buffers().len(), 1, "one buffer: the whole file");
        let arena = arena::arena_of(image).expect("the file is the row group's arena");
        let inner = arena::first_view_array(&after).unwrap();
        assert!(Arc::ptr_eq(&arena::arena_of(inner).unwrap(), &arena));
        let hf = after.column(2).as_struct().column(0).as_binary_view();
        assert!(Arc::ptr_eq(&arena::arena_of(hf).unwrap(), &arena), "a struct's bytes too");
        // Every other column is over the mapping as well: nothing was copied.
        let labels = after.column(1).to_data().buffers()[0].as_ptr() as usize;
        let base = arena.bytes().as_ptr() as usize;
        assert!(labels >= base && labels < base + arena.len() as usize);
    }

    #[test]
    fn damaged_or_foreign_files_are_errors_never_panics() {
        let before = row_group();
        let (f, _) = kept(&before);
        let good = std::fs::read(f.path()).unwrap();
        let schema = before.schema();
        let try_load = |bytes: &[u8], rows: usize| {
            let f = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(f.path(), bytes).unwrap();
            load(File::open(f.path()).unwrap(), "t", &schema, rows)
        };
        assert!(try_load(&good, 40).is_ok());
        assert!(try_load(&good, 41).is_err(), "rows must match the row group");
        assert!(try_load(&[], 40).is_err());
        assert!(try_load(&good[..good.len() / 2], 40).is_err());
        // Every byte of the file flipped in turn (a sample of them): an error or the same rows.
        for at in (0..good.len()).step_by(7) {
            let mut bad = good.clone();
            bad[at] ^= 0x5a;
            if let Ok(b) = try_load(&bad, 40) {
                assert_eq!(b.num_rows(), 40);
            }
        }
        // Another projection's file (a column less) is refused.
        let other = before.project(&[0, 1]).unwrap();
        let (f, file) = kept(&other);
        assert!(load(file, "t", &schema, 40).unwrap_err().to_string().contains("projection"));
        drop(f);
    }
}
