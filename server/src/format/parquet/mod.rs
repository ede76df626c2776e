//! Parquet shards: a sample is a row, a shard's table is its footer (row groups, column chunks),
//! and a batch leaves the daemon as one Arrow IPC stream of the selected columns.
//!
//! The pieces, each usable on its own (the format seam plugs them into datasets and streams):
//!
//! - [`footer`]: finds and decodes a file's footer from one speculative tail read (a second read
//!   only when the footer is larger), validates it, and summarises it as a [`ParquetTable`]: row
//!   groups with their row counts and each column chunk's byte range. Never panics on damaged
//!   bytes: arrow-rs asserts on some malformed metadata, so decoding runs under
//!   [`crate::panics::catch`] and a panic becomes a [`ParquetError`].
//! - [`pqidx`]: the per-file sidecar, which is the footer's own bytes behind a checked header, so a
//!   restarted daemon or `shardstream index` output needs no tail read at all.
//! - [`footers`]: every file's sidecar in one object, which `shardstream index` writes beside the
//!   manifest: a dataset opens with two reads, whatever its number of files.
//! - [`schema`]: the dataset's Arrow schema from the first file, the projection of the selected
//!   fields, and the agreement check of every other file (a `ValueError`-kind error naming the file
//!   and column, raised when the dataset is opened, not mid-epoch).
//! - [`nulls`]: which delivered columns may hold a null anywhere in the dataset (from the
//!   footers' statistics), marked on their fields so a column's form in Python is the same in
//!   every batch.
//! - [`partitions`]: the keys of a Hive-partitioned dataset's directories as typed columns, one
//!   constant column per file.
//! - [`widen`]: the narrower types a later file may hold a column in (int32 for int64, string for
//!   large_string), widened as its row groups are decoded.
//! - [`decode`]: decodes one row group of the selected columns; only their column chunks are read.
//! - [`pages`]: checks a column chunk's page headers against its bytes before arrow-rs sizes
//!   buffers from them.
//! - [`ipc`]: gathers rows of decoded row groups into one record batch and writes it as an Arrow
//!   IPC stream (schema + one batch, uncompressed, 64-byte aligned) into a ring slot or a `Vec`.
//! - [`direct`]: the same stream written straight from the decoded row groups' rows into the slot
//!   (one copy of each byte instead of two) when every selected column is flat.
//! - [`dataset`]: the files of a dataset as plan units (row groups) and the assembly of a batch
//!   from row ids.
//! - [`projected`]: the selected column chunks of a whole file as one compact byte string (what
//!   the node cache holds of an S3 file when a stream selects some of its columns).
//! - [`mapped`]: row groups decoded over the mapping of a node-cache copy of their file; values
//!   stored uncompressed are served from the copy itself (it is their arena).
//! - [`recycled`]: column-chunk read buffers that go back to a pool when their row group is
//!   dropped, so a cold epoch reads into memory already touched.
//! - [`decoded`]: the daemon-wide, byte-bounded cache of decoded row groups that streams share, so
//!   a shuffle window of row groups is decoded about once per epoch and node.

pub mod arena;
pub mod dataset;
pub mod decode;
pub mod decoded;
pub mod direct;
pub mod footer;
pub mod footers;
mod idl;
pub mod ipc;
pub mod kept;
pub mod mapped;
pub mod nulls;
pub mod pages;
pub mod partitions;
pub mod pqidx;
pub mod projected;
pub mod recycled;
pub mod schema;
pub mod strings;
mod thrift;
pub mod widen;
pub mod zones;

pub use footer::ParquetTable;
pub use schema::Projection;

use crate::Error;

/// The format's name in manifests (`shard_format`) and `DatasetInfo.format`.
pub const PARQUET: &str = "parquet";
/// File extension that listing treats as a Parquet shard.
pub const EXTENSION: &str = ".parquet";

/// What is wrong with a Parquet file or with a request against it. Converted into the crate's
/// [`Error`] by [`ParquetError::into_error`], which names the file.
#[derive(Debug, thiserror::Error)]
pub enum ParquetError {
    #[error("not a Parquet file: {0}")]
    NotParquet(String),
    #[error("truncated Parquet file: {0}")]
    Truncated(String),
    #[error("encrypted Parquet footers are not supported")]
    Encrypted,
    #[error("corrupt Parquet footer: {0}")]
    BadFooter(String),
    #[error("corrupt data in row group {row_group}: {reason}")]
    BadData { row_group: usize, reason: String },
    /// Values of a later file's narrower type that do not fit the dataset's type (times past
    /// what 64-bit ticks of a finer unit hold, offsets past 32 bits): the file is sound, the
    /// dataset's files do not agree ([`widen`]).
    #[error("row group {row_group}: {reason}")]
    Unfit { row_group: usize, reason: String },
    /// A selected column the file does not have (a request error, not a damaged file).
    #[error("has no column {column:?} (its columns: {available})")]
    MissingColumn { column: String, available: String },
    /// A selected column named like the row-id column every batch gets
    /// ([`dataset::ROW_COLUMN`]): its values would be taken for the row ids, or hidden by them.
    #[error(
        "has a column {column:?}, the name of the row ids every batch gets; leave it out with fields=[...] \
         or rename it in the files"
    )]
    ReservedColumn { column: String },
    /// A partition key (a `key=value` directory) that is a column of some files and not of
    /// others (`here`: of this file, not of the dataset's first).
    #[error(
        "{}", if *here {
            format!("has a column {column:?}, a partition key of the dataset's directories (key=value) that the \
                dataset's first file has no column for: write it into every file or into none")
        } else {
            format!("has no column {column:?}, a partition key of the dataset's directories (key=value) that the \
                dataset's first file has as a column too: write it into every file or into none")
        }
    )]
    KeyColumnInSome { column: String, here: bool },
    /// A file whose column for a partition key holds other values than its directory names (the
    /// footer's statistics say): the file is not in its partition.
    #[error(
        "holds {found} in column {column:?} (its footer's statistics, row group {row_group}) but its directory \
         says {column}={value}: the file is not in its partition; move it or correct the column"
    )]
    KeyColumnDiffers { column: String, value: String, found: String, row_group: usize },
    /// A selected column whose name the file gives to more than one column.
    #[error(
        "column {column:?} appears {count} times in this file: columns are selected by name, so which one is \
         meant cannot be told; select the others with fields=[...] or rename one in the files"
    )]
    DuplicateColumn { column: String, count: usize },
    /// A selected column whose type differs from the dataset's (first file's).
    #[error("column {column:?} is {found} here but {expected} in the dataset's first file{hint}")]
    TypeMismatch { column: String, expected: String, found: String, hint: &'static str },
    /// A selected column compressed with a codec this build does not decode.
    #[error(
        "column {column:?} is compressed with {codec}, which this build does not decode (snappy, zstd, gzip and uncompressed are)"
    )]
    UnsupportedCodec { column: String, codec: String },
    #[error("Arrow IPC: {0}")]
    Ipc(String),
    /// The batch does not fit the slot it must be written into.
    #[error("the batch needs {needed} bytes of Arrow IPC but its ring slot holds {capacity}")]
    SlotTooSmall { needed: usize, capacity: usize },
    #[error("I/O: {0}")]
    Io(String),
    /// A row group whose out-of-line binary values do not fit the 32-bit offsets of views.
    #[error(
        "its binary values total {bytes} bytes, over the 4 GiB a binary view can address: read it without \
         binary_views, or write the file with smaller row groups"
    )]
    ViewsTooLarge { bytes: u64 },
}

impl ParquetError {
    /// The crate error for this failure in file `file` (a path or an `s3://` URL): schema and
    /// column errors are the caller's (`InvalidArgument`, a Python `ValueError`), everything
    /// else is a damaged shard.
    pub fn into_error(self, file: &str) -> Error {
        self.into_error_at(file, None)
    }

    /// As [`Self::into_error`], a damaged shard's error saying where in the file (`at`).
    pub fn into_error_at(self, file: &str, at: Option<u64>) -> Error {
        match self {
            e @ (ParquetError::MissingColumn { .. }
            | ParquetError::TypeMismatch { .. }
            | ParquetError::ReservedColumn { .. }
            | ParquetError::DuplicateColumn { .. }
            | ParquetError::KeyColumnInSome { .. }
            | ParquetError::KeyColumnDiffers { .. }
            | ParquetError::UnsupportedCodec { .. }
            | ParquetError::Unfit { .. }) => Error::InvalidArgument(format!("Parquet file {file}: {e}")),
            e @ (ParquetError::Ipc(_) | ParquetError::SlotTooSmall { .. }) => {
                Error::Internal(format!("Parquet file {file}: {e}"))
            }
            e => Error::Shard { shard: file.to_string(), offset: at, reason: e.to_string() },
        }
    }
}

/// Runs `f`, turning a panic inside arrow-rs (it asserts on some malformed input) into an error
/// made by `on_panic` from the panic's message and place (see [`crate::panics::catch`]: the
/// daemon's log then shows the error, not the panic).
pub(crate) fn no_panic<T>(
    f: impl FnOnce() -> Result<T, ParquetError>,
    on_panic: impl FnOnce(String) -> ParquetError,
) -> Result<T, ParquetError> {
    crate::panics::catch(f).unwrap_or_else(|caught| Err(on_panic(caught.to_string())))
}

#[cfg(test)]
pub(crate) mod testdata;
