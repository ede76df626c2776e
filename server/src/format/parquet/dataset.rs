//! A Parquet dataset as the plan sees it: an ordered list of files whose rows are the samples,
//! cut into **plan units** that are row groups, and the assembly of a batch from row ids.
//!
//! Row ids are global: files in dataset order, rows in file order (`ArrowBatch.row_ids`). The
//! plan is given the row counts of the row groups as its "shards" (its input is only a list of
//! counts, and unit `u`'s ids are the running sum of the counts before it, which is exactly the
//! global row numbering). So, with no change to the plan: the unit order is a permutation of
//! row groups, and a shuffle window of `W` units is `W` row groups, the I/O and decode unit;
//! exactly-once, equal counts per rank, `drop_last`, worker split and resume hold as for TAR.
//!
//! Files without rows (zero row groups, or only empty ones) are skipped with a warning when the
//! dataset is built: they own no row id, so nothing in the plan changes for them. A 0-byte file (a
//! writer that never finished) is a `ShardError` naming it, like any other damaged file.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::Relaxed};

use arrow_array::RecordBatch;
use arrow_schema::{DataType, Schema, SchemaRef};
use bytes::Bytes;

use super::decode::{chunk_ranges, decode_row_group, projected_bytes, read_row_group};
use super::decoded::{DatasetTag, DecodedCache, OutgrownShare, RowGroupKey};
use super::mapped::{self, MappedFile};
use super::partitions::Partitions;
use super::schema::{FileProjection, Projection};
use super::{ParquetError, ParquetTable, direct, footer, ipc, recycled};
use crate::{Error, Result};

/// One file of the dataset.
#[derive(Debug, Clone)]
pub struct DatasetFile {
    /// How errors name it: a path or an `s3://` URL.
    pub name: String,
    pub table: Arc<ParquetTable>,
    /// Its position in the dataset's list of files (what a [`FileReader`] is asked for; files
    /// without rows are left out of the dataset but keep their positions).
    pub index: usize,
}

/// The files and plan units of a Parquet dataset.
#[derive(Debug, Clone)]
pub struct ParquetDataset {
    files: Vec<DatasetFile>,
    /// (file, row group) of every plan unit, in row-id order.
    units: Vec<(u32, u32)>,
    /// Rows of every unit (the plan's "shard sample counts").
    unit_rows: Vec<u64>,
    /// First row id of every unit, then the total.
    unit_starts: Vec<u64>,
    /// The partition keys of a Hive-partitioned dataset (values by [`DatasetFile::index`]).
    partitions: Option<Arc<Partitions>>,
}

impl ParquetDataset {
    /// The dataset of `files` in order; files without rows are left out (logged), and their names
    /// returned.
    pub fn new(files: Vec<DatasetFile>) -> Result<(Self, Vec<String>)> {
        let mut kept = Vec::with_capacity(files.len());
        let mut skipped = Vec::new();
        let (mut units, mut unit_rows, mut unit_starts) = (Vec::new(), Vec::new(), vec![0u64]);
        for f in files {
            if f.table.num_rows() == 0 {
                tracing::warn!(file = %f.name, "skipping a Parquet file without rows");
                skipped.push(f.name);
                continue;
            }
            let fi = u32::try_from(kept.len()).map_err(|_| Error::invalid("more than 2^32 Parquet files"))?;
            for rg in 0..f.table.num_row_groups() {
                let rows = f.table.row_group_rows(rg);
                if rows == 0 {
                    continue;
                }
                let rg = u32::try_from(rg).map_err(|_| Error::invalid("more than 2^32 row groups in a file"))?;
                units.push((fi, rg));
                unit_rows.push(rows);
                let last = unit_starts.last().copied().unwrap_or(0);
                unit_starts.push(last.checked_add(rows).ok_or_else(|| Error::invalid("row count overflows"))?);
            }
            kept.push(f);
        }
        Ok((Self { files: kept, units, unit_rows, unit_starts, partitions: None }, skipped))
    }

    /// This dataset with the partition keys its files' directories give.
    pub fn with_partitions(mut self, partitions: Option<Partitions>) -> Self {
        self.partitions = partitions.map(Arc::new);
        self
    }

    /// The partition keys as columns (none when the dataset is not partitioned).
    pub fn keys(&self) -> &[arrow_schema::Field] {
        self.partitions.as_ref().map_or(&[], |p| p.fields())
    }

    /// The partition values of `file` ([`DatasetFile::index`]).
    fn key_values(&self, file: &DatasetFile) -> &[super::partitions::KeyValue] {
        self.partitions.as_ref().map_or(&[], |p| p.values(file.index))
    }

    pub fn files(&self) -> &[DatasetFile] {
        &self.files
    }

    pub fn num_rows(&self) -> u64 {
        self.unit_starts.last().copied().unwrap_or(0)
    }

    /// Rows of every plan unit (row group), in row-id order: the plan's input.
    pub fn unit_rows(&self) -> &[u64] {
        &self.unit_rows
    }

    /// (file, row group) of plan unit `u`.
    pub fn unit(&self, u: usize) -> Option<(usize, usize)> {
        self.units.get(u).map(|&(f, rg)| (f as usize, rg as usize))
    }

    /// (plan unit, row within it) of row id `row`.
    pub fn locate(&self, row: u64) -> Option<(usize, usize)> {
        if row >= self.num_rows() {
            return None;
        }
        let u = self.unit_starts.partition_point(|&s| s <= row) - 1;
        Some((u, usize::try_from(row - self.unit_starts[u]).ok()?))
    }

    /// Rows of each file (in dataset order): the files' sample counts for figures that count
    /// files rather than row groups.
    pub fn file_rows(&self) -> Vec<u64> {
        self.files.iter().map(|f| f.table.num_rows()).collect()
    }

    /// The projection of `fields` (None = all), checked against every file: a file without a
    /// selected column, or with another type for it, is an `InvalidArgument` naming the file and
    /// the column. Columns that may hold a null in some file are marked ([`super::nulls`]).
    pub fn projection(&self, fields: Option<&[String]>) -> Result<Projection> {
        let Some(first) = self.files.first() else {
            return Err(Error::invalid("the Parquet dataset has no rows"));
        };
        let mut p =
            Projection::new(first.table.schema(), self.keys(), fields).map_err(|e| e.into_error(&first.name))?;
        for f in &self.files[1..] {
            p.agree(&f.table).map_err(|e| e.into_error(&f.name))?;
        }
        // Keys the files hold as columns too: each file's column must be what its directory says.
        if let Some(parts) = &self.partitions {
            for f in &self.files {
                for (key, name) in p.key_columns() {
                    super::partitions::check_key_column(&f.table, name, parts.raw_value(f.index, *key))
                        .map_err(|e| e.into_error(&f.name))?;
                }
            }
        }
        p.mark_nulls(self.files.iter().map(|f| (&*f.table, self.key_values(f))));
        Ok(p)
    }
}

/// Most row groups one batch decodes at once: one per core (the decoder is CPU-bound), at most 8
/// (a window's worth; more would only hold more undelivered decoded bytes at a time).
pub const DECODE_THREADS: usize = 8;

/// Asked once per process: `available_parallelism` reads the cgroup's CPU quota from /proc and
/// /sys on every call (open, read, close of several files), which cost ~14% of the daemon's time
/// when it was asked once per batch of small rows (bench/PARQUET_PROFILE.md).
fn decode_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(2, |n| n.get()).min(DECODE_THREADS))
}

/// Reads the files of a dataset ([`DatasetFile::index`]).
pub trait FileReader: Sync {
    /// Exactly `len` bytes of file `file` at `offset`. Implementations read into a buffer of
    /// [`recycled::pool`] without zero-filling it first: a cold epoch reads every column chunk
    /// this way, and the zero fill of its buffers was ~6% of the daemon's time, the fresh pages
    /// of new buffers 10-12% (bench/PARQUET_PROFILE.md).
    fn read_bytes(&self, file: usize, offset: u64, len: usize) -> Result<Bytes>;

    /// The node-cache copy row group `rg` of `file` is read from, which the daemon may map
    /// because it never changes (see [`super::mapped`]); None for a file read in place.
    fn cached_copy(&self, _file: usize, _rg: usize) -> Result<Option<CachedCopy>> {
        Ok(None)
    }

    /// The node-cache copy row group `rg` of `file` is read from ([`Self::cached_copy`]) fetched
    /// again, because it did not decode (`why`); None when there is no copy to fetch again. A
    /// copy's checks cover its pages' bytes, not their headers (no Parquet checksum does), so a
    /// header spoilt in transit is found only by decoding; kept, it failed every stream that
    /// read it until evicted.
    fn fetch_again(&self, _file: usize, _rg: usize, _why: &str) -> Result<Option<CachedCopy>> {
        Ok(None)
    }
}

/// A node-cache copy of a dataset file ([`FileReader::cached_copy`]).
#[derive(Debug)]
pub struct CachedCopy {
    /// The copy, opened read-only.
    pub file: std::fs::File,
    /// Device and inode: a copy fetched again after an eviction is another file.
    pub identity: (u64, u64),
    /// Where the file's bytes lie in the copy: None for a whole copy, the pieces for a compact
    /// copy of some column chunks.
    pub locate: Option<Arc<super::projected::ProjectedFile>>,
}

impl CachedCopy {
    /// `file` (a node-cache copy) with its identity.
    pub fn new(file: std::fs::File, locate: Option<Arc<super::projected::ProjectedFile>>) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata()?;
        Ok(Self { file, identity: (m.dev(), m.ino()), locate })
    }
}

/// Local files (or node-cache copies), opened once.
#[derive(Debug)]
pub struct LocalFiles(pub Vec<crate::storage::local::ShardFile>);

impl FileReader for LocalFiles {
    fn read_bytes(&self, file: usize, offset: u64, len: usize) -> Result<Bytes> {
        let f = self.0.get(file).ok_or_else(|| Error::Internal(format!("no Parquet file {file}")))?;
        read_recycled(f, len, offset)
    }
}

/// Exactly `len` bytes of `file` at `offset`, read into a buffer of [`recycled::pool`].
pub fn read_recycled(file: &crate::storage::local::ShardFile, len: usize, offset: u64) -> Result<Bytes> {
    let pool = recycled::pool();
    let mut buf = pool.take(len);
    file.read_append(&mut buf, len, offset)?;
    Ok(pool.share(buf))
}

/// The column of each delivered batch that holds its rows' ids (`uint64`, last); a dataset column
/// of that name is refused when selected (it would pass for the ids). Clients used to
/// append it to every batch themselves, a fixed cost per batch as large as opening the batch
/// (bench/PARQUET_PROFILE.md); written by the daemon it is 8 bytes a row in the same copy.
pub const ROW_COLUMN: &str = "__row__";

/// Assembles batches of one projection of a dataset: decodes the row groups the rows live in
/// (through the shared [`DecodedCache`]) and gathers the rows.
#[derive(Debug)]
pub struct BatchAssembler {
    dataset: Arc<ParquetDataset>,
    projection: Projection,
    /// What batches hold: the projection's columns, then [`ROW_COLUMN`] (the projection has
    /// no column of that name: [`Projection::new`] refuses one).
    delivered: SchemaRef,
    per_file: Vec<FileProjection>,
    cache: Arc<DecodedCache>,
    /// Names the dataset version in cache keys (its fingerprint).
    dataset_id: DatasetTag,
    projection_id: u64,
    /// The delivered schema's IPC schema message, as every batch's stream begins (made once).
    schema_message: Vec<u8>,
    /// Binary columns are delivered as views into arenas ([`Self::with_binary_views`]).
    views: bool,
    /// Where decoded row groups are kept on disk ([`Self::with_kept`]).
    kept: Option<Arc<dyn super::kept::KeptRowGroups>>,
    /// Without views: set by the first row group decoded a second time (the budget cannot hold
    /// this projection); from then on every row group this stream uses is kept.
    spilling: AtomicBool,
    /// Per plan unit, while spilling: [`UNKEPT`], [`QUEUED`] or [`SETTLED`].
    keeping: Arc<Vec<AtomicU8>>,
    /// Set when the projection, decoded, cannot fit the decoded budget ([`Self::with_window`]).
    outgrown: Option<OutgrownShare>,
}

/// States of a plan unit's keeping ([`BatchAssembler::keep_later`]): not kept, handed to the
/// writer, kept (or no room for it: not tried again).
const UNKEPT: u8 = 0;
const QUEUED: u8 = 1;
const SETTLED: u8 = 2;

/// Field metadata key of a column delivered as views ([`BatchAssembler::with_binary_views`]): a
/// `fixed_size_binary(16)` column of Arrow binary views; the value names the column's type
/// ("binary" or "large_binary").
pub use shardstream_proto::ARROW_VIEW_KEY as VIEW_KEY;

/// `f` with its `binary`/`large_binary` types, at the top or inside structs, delivered as views:
/// `fixed_size_binary(16)` marked with [`VIEW_KEY`] (its value: the type it stands for). Sets
/// `any` when it changed one.
fn as_views(f: &arrow_schema::Field, any: &mut bool) -> arrow_schema::Field {
    let name = match f.data_type() {
        DataType::Binary => "binary",
        DataType::LargeBinary => "large_binary",
        DataType::Struct(children) => {
            let children: arrow_schema::Fields = children.iter().map(|c| as_views(c, any)).collect();
            return f.clone().with_data_type(DataType::Struct(children));
        }
        _ => return f.clone(),
    };
    *any = true;
    let mut meta = f.metadata().clone();
    meta.insert(VIEW_KEY.to_owned(), name.to_owned());
    f.clone().with_data_type(DataType::FixedSizeBinary(16)).with_metadata(meta)
}

/// Units a batch may draw on before [`BatchAssembler::places`] looks them up in a map instead of
/// scanning them.
const SCANNED_UNITS: usize = 16;

/// Where a batch's rows lie ([`BatchAssembler::places`]): the plan units it draws on, in the
/// order first drawn on, and per row in batch order `(index into units, row in that unit)`.
#[derive(Debug)]
pub struct RowPlaces {
    pub units: Vec<usize>,
    pub rows: Vec<(usize, usize)>,
}

/// The rows of one batch: the decoded row groups it draws on and, per row in batch order,
/// `(source, row)` in them; with their ids when the batch delivers them ([`ROW_COLUMN`]).
#[derive(Debug)]
pub struct BatchRows {
    pub sources: Vec<Arc<RecordBatch>>,
    pub rows: Vec<(usize, usize)>,
    pub ids: Option<Vec<u64>>,
}

impl BatchRows {
    fn refs(&self) -> Vec<&RecordBatch> {
        self.sources.iter().map(|b| b.as_ref()).collect()
    }

    /// The rows `run` of the batch (in batch order), over the same decoded row groups: a part of
    /// a batch sent as several messages. `None` when `run` is not within the batch.
    pub fn run(&self, run: std::ops::Range<usize>) -> Option<BatchRows> {
        let ids = match &self.ids {
            Some(ids) => Some(ids.get(run.clone())?.to_vec()),
            None => None,
        };
        Some(BatchRows { sources: self.sources.clone(), rows: self.rows.get(run)?.to_vec(), ids })
    }

    /// The rows gathered from the sources into a batch of `schema` (the delivered schema), the
    /// ids appended as its last column when the batch has them.
    fn gather_sources(&self, schema: &SchemaRef) -> Result<RecordBatch> {
        let internal = |e: ParquetError| Error::Internal(e.to_string());
        let Some(ids) = &self.ids else {
            return ipc::gather(schema, &self.refs(), &self.rows).map_err(internal);
        };
        let fields = schema.fields();
        let Some(gathered) = fields.len().checked_sub(1).map(|n| Arc::new(Schema::new(fields[..n].to_vec()))) else {
            return Err(Error::Internal("a batch with row ids has no columns".into()));
        };
        let batch = ipc::gather(&gathered, &self.refs(), &self.rows).map_err(internal)?;
        let mut columns = batch.columns().to_vec();
        columns.push(Arc::new(arrow_array::UInt64Array::from(ids.clone())));
        RecordBatch::try_new(schema.clone(), columns)
            .map_err(|e| Error::Internal(format!("cannot append the row ids to a gathered batch: {e}")))
    }

    /// The rows as one record batch of `schema` (a copy of every row). Row groups decoded with
    /// views (flat projections, [`super::schema`]) are gathered through the direct writer and
    /// read back, so the batch has the delivered types; that path serves tests and tools, the
    /// transports write the IPC bytes ([`Self::encode`], or straight into a slot).
    pub fn gather(&self, schema: &SchemaRef, schema_message: &[u8]) -> Result<RecordBatch> {
        let views = self
            .sources
            .iter()
            .any(|b| b.columns().iter().any(|c| matches!(c.data_type(), DataType::BinaryView | DataType::Utf8View)));
        if !views {
            return self.gather_sources(schema);
        }
        let bytes = self.encode(schema, schema_message)?;
        let mut reader = arrow_ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)
            .map_err(|e| Error::Internal(format!("cannot read back a gathered batch: {e}")))?;
        match reader.next() {
            Some(Ok(b)) => Ok(b),
            Some(Err(e)) => Err(Error::Internal(format!("cannot read back a gathered batch: {e}"))),
            None => Err(Error::Internal("a gathered batch's stream holds no batch".into())),
        }
    }

    /// The rows as one Arrow IPC stream (what the inline transport sends): written straight from
    /// the decoded row groups when every column is flat, else gathered and encoded.
    pub fn encode(&self, schema: &SchemaRef, schema_message: &[u8]) -> Result<Vec<u8>> {
        self.with_direct(schema, schema_message, |plan| match plan {
            Some(plan) => {
                let mut out = vec![0u8; plan.stream_len()];
                plan.write(&mut out).map_err(|e| Error::Internal(e.to_string()))?;
                Ok(out)
            }
            None => ipc::encode(&self.gather_sources(schema)?).map_err(|e| Error::Internal(e.to_string())),
        })
    }

    /// Runs `f` with the rows' plan for writing them straight into IPC bytes, or with `None`
    /// when a column is not flat (then [`Self::gather`] is the way).
    pub fn with_direct<T>(
        &self,
        schema: &Schema,
        schema_message: &[u8],
        f: impl FnOnce(Option<&direct::Direct<'_>>) -> Result<T>,
    ) -> Result<T> {
        let refs = self.refs();
        let plan = direct::Direct::plan(schema, schema_message, &refs, &self.rows, self.ids.as_deref())
            .map_err(|e| Error::Internal(e.to_string()))?;
        f(plan.as_ref())
    }
}

impl BatchAssembler {
    pub fn new(
        dataset: Arc<ParquetDataset>,
        projection: Projection,
        cache: Arc<DecodedCache>,
        dataset_id: &str,
    ) -> Result<Self> {
        let per_file = dataset
            .files
            .iter()
            .map(|f| projection.for_file(&f.table, dataset.key_values(f)).map_err(|e| e.into_error(&f.name)))
            .collect::<Result<Vec<_>>>()?;
        let projection_id = crate::stable_hash::hash_fields(projection.names().map(str::as_bytes));
        let schema = projection.schema();
        let mut fields = schema.fields().to_vec();
        fields.push(Arc::new(arrow_schema::Field::new(ROW_COLUMN, DataType::UInt64, true)));
        let delivered = Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()));
        let schema_message = direct::schema_message(&delivered).map_err(|e| Error::Internal(e.to_string()))?;
        Ok(Self {
            dataset,
            projection,
            delivered,
            per_file,
            cache,
            dataset_id: DatasetTag::new(dataset_id),
            projection_id,
            schema_message,
            views: false,
            kept: None,
            spilling: AtomicBool::new(false),
            keeping: Arc::new(Vec::new()),
            outgrown: None,
        })
    }

    /// This assembler, for a stream whose shuffle window is `window` plan units (row groups):
    /// when the projection's row groups, decoded, add up to more than the decoded budget, they
    /// are kept only within what this stream's window claims (see [`super::decoded`]).
    pub fn with_window(mut self, window: u32) -> Self {
        let (total, largest) = self.projected_sizes();
        self.outgrown = self.cache.share_for(total, largest.saturating_mul(u64::from(window.max(1))));
        self
    }

    /// The projection's row groups decoded, all files, and the largest of them, as the footers
    /// tell it ([`projected_bytes`]).
    pub fn projected_sizes(&self) -> (u64, u64) {
        let (mut total, mut largest) = (0u64, 0u64);
        for (file, proj) in self.dataset.files.iter().zip(&self.per_file) {
            for rg in 0..file.table.num_row_groups() {
                let bytes = projected_bytes(&file.table, rg, proj);
                total = total.saturating_add(bytes);
                largest = largest.max(bytes);
            }
        }
        (total, largest)
    }

    /// Whether the projection outgrew the decoded budget ([`Self::with_window`]).
    pub fn outgrown(&self) -> bool {
        self.outgrown.is_some()
    }

    /// This assembler, keeping row groups in `kept` and loading them from there (see
    /// [`super::kept`]): with [`Self::with_binary_views`] every row group it decodes, at once;
    /// without, once it decodes a row group a second time (the decoded budget could not hold
    /// it), every row group it uses, in the background, and only when every selected column is
    /// flat. Call it after [`Self::with_binary_views`].
    pub fn with_kept(mut self, kept: Arc<dyn super::kept::KeptRowGroups>) -> Self {
        self.kept = (self.views || self.per_file.iter().all(FileProjection::views)).then_some(kept);
        self.keeping = Arc::new((0..self.dataset.units.len()).map(|_| AtomicU8::new(UNKEPT)).collect());
        self
    }

    /// Whether a row group this stream uses, decoded in memory, is to be kept on disk now.
    fn spills(&self) -> bool {
        !self.views && self.kept.is_some() && self.spilling.load(Relaxed)
    }

    /// What tells this assembler's decoded row groups apart from other projections' (the
    /// delivered columns in order, and whether binary columns are views).
    pub fn projection_id(&self) -> u64 {
        self.projection_id
    }

    /// This assembler, delivering its `binary`/`large_binary` columns (at the top, or inside
    /// structs: a Hugging Face image is `{bytes, path}`) as views into arenas (see
    /// [`super::arena`]): each such column is a `fixed_size_binary(16)` column of Arrow binary
    /// views, marked with [`VIEW_KEY`], and the row groups it decodes keep their binary values in
    /// arenas (cached apart from other streams' row groups). An error when the projection has no
    /// such column or is not decoded as views (a list or other nested column).
    pub fn with_binary_views(mut self) -> Result<Self> {
        // No binary column first: then whether the others decode as views is beside the point.
        let mut any = false;
        let fields: Vec<arrow_schema::FieldRef> =
            self.delivered.fields().iter().map(|f| Arc::new(as_views(f, &mut any))).collect();
        if !any {
            return Err(Error::invalid(
                "binary_views: none of the selected columns is binary (binary or large_binary, at the top or \
                 inside a struct)",
            ));
        }
        if !self.per_file.iter().all(FileProjection::views) {
            // A file's bytes columns may also fail to decode as views (arrow-rs refusing the
            // hint) although every column is flat: then no column is to blame.
            let why = match self.delivered.fields().iter().find(|f| !direct::is_flat(f.data_type())) {
                Some(f) => format!("column {:?} is {}, not flat", f.name(), f.data_type()),
                None => "a file's bytes columns cannot be decoded as views".to_string(),
            };
            return Err(Error::invalid(format!(
                "binary_views needs every selected column to be flat (numbers, strings, binary, \
                 structs of those), but {why}; select fewer fields"
            )));
        }
        self.delivered = Arc::new(Schema::new_with_metadata(fields, self.delivered.metadata().clone()));
        self.schema_message = direct::schema_message(&self.delivered).map_err(|e| Error::Internal(e.to_string()))?;
        // Row groups with arenas are cached apart from the same projection's plain ones.
        self.projection_id ^= 0x9e37_79b9_7f4a_7c15;
        self.views = true;
        Ok(self)
    }

    /// Whether binary columns are delivered as views ([`Self::with_binary_views`]).
    pub fn binary_views(&self) -> bool {
        self.views
    }

    /// The projection's IPC schema message (see [`direct::schema_message`]).
    pub fn schema_message(&self) -> &[u8] {
        &self.schema_message
    }

    pub fn projection(&self) -> &Projection {
        &self.projection
    }

    /// The schema of the batches: the projection's, then [`ROW_COLUMN`].
    pub fn schema(&self) -> &SchemaRef {
        &self.delivered
    }

    pub fn dataset(&self) -> &ParquetDataset {
        &self.dataset
    }

    /// The projection of each file, in the order of [`ParquetDataset::files`].
    pub fn per_file(&self) -> &[FileProjection] {
        &self.per_file
    }

    /// The record batch of rows `row_ids`, in that order.
    ///
    /// The row groups it draws on that are not decoded yet are decoded in parallel (up to
    /// [`DECODE_THREADS`] at once): a shuffled batch draws on every row group of its window, so the
    /// first batch of an epoch (and the first after the window moves on) waits for a window's
    /// worth of decoding, which one thread did one row group after the other.
    pub fn batch(&self, row_ids: &[u64], files: &dyn FileReader) -> Result<RecordBatch> {
        self.rows(row_ids, files)?.gather(&self.delivered, &self.schema_message)
    }

    /// The rows of the batch of `row_ids` (decoding its row groups as [`Self::batch`] does),
    /// for a caller that writes them straight into IPC bytes ([`direct`]).
    pub fn rows(&self, row_ids: &[u64], files: &dyn FileReader) -> Result<BatchRows> {
        let places = self.places(row_ids)?;
        self.rows_at(places, row_ids, files)
    }

    /// Where the rows `row_ids` lie, without reading anything: the plan units (row groups) they
    /// draw on and each row's place in them.
    pub fn places(&self, row_ids: &[u64]) -> Result<RowPlaces> {
        let mut units: Vec<usize> = Vec::new();
        // A batch draws on a window's few row groups: a scan of those few finds a unit's source
        // in a handful of predictable compares, cheaper per row than a map (an ordered map
        // beat SipHash, bench/PARQUET_PROFILE.md); a wider batch switches to the ordered map.
        let mut source_of: Option<BTreeMap<usize, usize>> = None;
        let mut rows = Vec::with_capacity(row_ids.len());
        for &id in row_ids {
            let (u, r) = self.dataset.locate(id).ok_or_else(|| {
                Error::invalid(format!("row id {id} is past the dataset's {} rows", self.dataset.num_rows()))
            })?;
            let s = match &mut source_of {
                Some(map) => *map.entry(u).or_insert_with(|| {
                    units.push(u);
                    units.len() - 1
                }),
                None => match units.iter().position(|&x| x == u) {
                    Some(s) => s,
                    None => {
                        units.push(u);
                        if units.len() > SCANNED_UNITS {
                            source_of = Some(units.iter().enumerate().map(|(s, &u)| (u, s)).collect());
                        }
                        units.len() - 1
                    }
                },
            };
            rows.push((s, r));
        }
        Ok(RowPlaces { units, rows })
    }

    /// One row id in each file `places` draws on (the first row of its first unit there), in
    /// the order first drawn on: what a caller opens, verifies and preloads before
    /// [`Self::rows_at`] reads.
    pub fn first_row_per_file(&self, places: &RowPlaces) -> Vec<u64> {
        let mut files: Vec<usize> = Vec::new();
        let mut out = Vec::new();
        for &u in &places.units {
            let (Some((fi, _)), Some(&start)) = (self.dataset.unit(u), self.dataset.unit_starts.get(u)) else {
                continue;
            };
            if !files.contains(&fi) {
                files.push(fi);
                out.push(start);
            }
        }
        out
    }

    /// The rows at `places` (of `row_ids`, from [`Self::places`]), their row groups from the
    /// cache or decoded now.
    pub fn rows_at(&self, places: RowPlaces, row_ids: &[u64], files: &dyn FileReader) -> Result<BatchRows> {
        let RowPlaces { units, rows } = places;
        let mut sources: Vec<Option<Arc<RecordBatch>>> = units.iter().map(|&u| self.cached(u)).collect();
        let missing: Vec<usize> = (0..units.len()).filter(|&i| sources[i].is_none()).collect();
        let threads = if missing.len() > 1 { decode_threads().min(missing.len()) } else { missing.len() };
        let decoded = if threads > 1 {
            crate::parallel::try_map(&missing, threads, |&i| self.row_group(units[i], files))?
        } else {
            missing.iter().map(|&i| self.row_group(units[i], files)).collect::<Result<Vec<_>>>()?
        };
        for (i, b) in missing.into_iter().zip(decoded) {
            sources[i] = Some(b);
        }
        let sources: Vec<Arc<RecordBatch>> = sources.into_iter().flatten().collect();
        if sources.len() != units.len() {
            return Err(Error::Internal("a row group of the batch was neither cached nor decoded".into()));
        }
        let ids = Some(row_ids.to_vec());
        Ok(BatchRows { sources, rows, ids })
    }

    fn key(&self, fi: usize, rg: usize) -> RowGroupKey {
        RowGroupKey {
            dataset: self.dataset_id.clone(),
            file: fi as u32,
            row_group: rg as u32,
            projection: self.projection_id,
        }
    }

    /// Row group `rg` of file `fi` as an earlier decode kept it on the node's disk (see
    /// [`super::kept`]), if there is one that loads. One that does not (damaged) is discarded.
    fn kept(&self, fi: usize, rg: usize) -> Option<(RecordBatch, (u64, u64))> {
        let kept = self.kept.as_ref()?;
        let file = &self.dataset.files[fi];
        let opened = kept.open(file.index, rg)?;
        let rows = usize::try_from(file.table.row_group_rows(rg)).ok()?;
        super::kept::load_or_discard(&**kept, file.index, rg, &file.name, opened, self.per_file[fi].schema(), rows)
    }

    /// `batch` (row group `rg` of file `fi`, just decoded) kept on the node's disk and loaded
    /// from there (the file is its arena), when the node cache takes it. None when it does not
    /// (no room, or the disk failed): the caller serves the row group from memory then (for
    /// views, in a memfd arena), as without a cache.
    fn keep(&self, fi: usize, rg: usize, batch: &RecordBatch) -> Option<(RecordBatch, (u64, u64))> {
        let kept = self.kept.as_ref()?;
        let file = &self.dataset.files[fi];
        let opened = super::kept::keep_now(&**kept, file.index, rg, &file.name, batch)?;
        super::kept::load_or_discard(&**kept, file.index, rg, &file.name, opened, batch.schema_ref(), batch.num_rows())
    }

    /// True when plan unit `u` is decoded in memory: a batch drawing on it reads no file bytes
    /// for it (unless the decoded row group leaves memory before the batch takes it).
    pub fn is_decoded(&self, u: usize) -> bool {
        self.cached(u).is_some()
    }

    /// Plan unit `u` when it is decoded already (and need not be kept now: see
    /// [`Self::row_group`]).
    fn cached(&self, u: usize) -> Option<Arc<RecordBatch>> {
        let (fi, rg) = self.dataset.unit(u)?;
        if self.spills() && self.keeping.get(u).is_some_and(|s| s.load(Relaxed) == UNKEPT) {
            return None;
        }
        self.cache.get(&self.key(fi, rg))
    }

    fn settle(&self, u: usize) {
        if let Some(s) = self.keeping.get(u) {
            s.store(SETTLED, Relaxed);
        }
    }

    /// Hands plan unit `u` (row group `rg` of file `fi`, decoded in memory as `batch`) to the
    /// kept row groups to write when convenient; once written, the decoded cache holds the kept
    /// file's mapping in place of `batch`, if it still holds the row group.
    fn keep_later(&self, u: usize, fi: usize, rg: usize, key: RowGroupKey, batch: &Arc<RecordBatch>) {
        let (Some(kept), Some(state)) = (self.kept.as_ref(), self.keeping.get(u)) else { return };
        if state.compare_exchange(UNKEPT, QUEUED, Relaxed, Relaxed).is_err() {
            return;
        }
        let file = &self.dataset.files[fi];
        let (keeping, cache, name, schema) =
            (self.keeping.clone(), self.cache.clone(), file.name.clone(), batch.schema());
        let (discard, index, rows) = (kept.clone(), file.index, batch.num_rows());
        let done: super::kept::Done = Box::new(move |opened| {
            let loaded =
                opened.and_then(|f| super::kept::load_or_discard(&*discard, index, rg, &name, f, &schema, rows));
            if let Some((b, over)) = loaded {
                cache.replace(&key, Arc::new(b), Some(over));
            }
            // Kept, or no room for it: either way not tried again by this stream.
            if let Some(s) = keeping.get(u) {
                s.store(SETTLED, Relaxed);
            }
        });
        if !kept.keep_later(file.index, rg, &file.name, batch.clone(), done) {
            // The writer is busy: the next use tries again.
            state.store(UNKEPT, Relaxed);
        }
    }

    /// The node-cache copy of file `fi`'s row group `rg` mapped ([`super::mapped`]), when it is
    /// read from one.
    fn mapped_copy(&self, fi: usize, rg: usize, files: &dyn FileReader) -> Result<Option<MappedFile>> {
        let file = &self.dataset.files[fi];
        let Some(copy) = files.cached_copy(file.index, rg)? else { return Ok(None) };
        self.map_copy(fi, copy).map(Some)
    }

    /// Node-cache copy `copy` of file `fi` mapped.
    fn map_copy(&self, fi: usize, copy: CachedCopy) -> Result<MappedFile> {
        let file = &self.dataset.files[fi];
        MappedFile::shared(copy.file, copy.identity, &file.name, file.table.file_len(), copy.locate)
            .map_err(|e| e.into_error(&file.name))
    }

    /// The decoded plan unit `u` (a row group), from the cache or decoded now.
    pub fn row_group(&self, u: usize, files: &dyn FileReader) -> Result<Arc<RecordBatch>> {
        let (fi, rg) = self.dataset.unit(u).ok_or_else(|| Error::Internal(format!("no plan unit {u}")))?;
        let file = &self.dataset.files[fi];
        let key = self.key(fi, rg);
        let batch = self.cache.get_or_decode_over(&key, self.outgrown.is_some(), || {
            if let Some((batch, over)) = self.kept(fi, rg) {
                self.settle(u);
                return Ok((batch, Some(over)));
            }
            let mut io_error = None;
            let mut copy = self.mapped_copy(fi, rg, files)?;
            let decode_copy = |m: &MappedFile| {
                m.chunks(&chunk_ranges(&file.table, rg, &self.per_file[fi]))
                    .and_then(|chunks| decode_row_group(&file.table, rg, &self.per_file[fi], chunks))
            };
            let mut decoded = copy.as_ref().map(decode_copy);
            // A copy that does not decode is fetched again, once (see `FileReader::fetch_again`):
            // a file damaged at its source fails the same way again, and that is the error.
            if let Some(Err(ParquetError::BadData { reason, .. })) = &decoded {
                let why = reason.clone();
                // Unmapped first: nothing of this read holds the copy then.
                copy = None;
                if let Some(again) = files.fetch_again(file.index, rg, &why)? {
                    let m = self.map_copy(fi, again)?;
                    decoded = Some(decode_copy(&m));
                    copy = Some(m);
                }
            }
            let decoded = match decoded {
                Some(decoded) => decoded,
                None => read_row_group(&file.table, rg, &self.per_file[fi], |off, len| {
                    files.read_bytes(file.index, off, len).map_err(|e| {
                        let msg = e.to_string();
                        io_error = Some(e);
                        ParquetError::Io(msg)
                    })
                })
                .map(|(batch, _)| batch),
            };
            // Values the file holds as they are served are served from its mapping: nothing to
            // copy into an arena or keep, and decoding again costs only the page headers.
            if let (Ok(batch), Some(m)) = (&decoded, &copy)
                && let Some(over_file) = mapped::rebase(batch, m.arena()).map_err(|e| e.into_error(&file.name))?
            {
                return Ok((over_file, Some(m.identity())));
            }
            match (decoded, io_error) {
                (Ok(batch), _) if self.views => {
                    if let Some((kept, over)) = self.keep(fi, rg, &batch) {
                        return Ok((kept, Some(over)));
                    }
                    // Not the file's fault: the segment is the daemon's (memory, descriptors).
                    let (batch, _) = super::arena::into_arena(batch, &file.name).map_err(|e| match e {
                        ParquetError::ViewsTooLarge { .. } => {
                            Error::invalid(format!("Parquet file {}: row group {rg}: {e}", file.name))
                        }
                        e => Error::Unavailable(format!("Parquet file {}: a row group for binary_views: {e}", file.name)),
                    })?;
                    Ok((batch, None))
                }
                (Ok(batch), _) => {
                    // Decoded before and let go of: the budget cannot hold this projection, and
                    // without kept copies every later epoch would decode it all again.
                    if self.kept.is_some() && !self.spills() && self.cache.decoded_before(&key) {
                        tracing::debug!(file = %file.name, row_group = rg, "a row group decoded again: keeping this stream's row groups on disk");
                        self.spilling.store(true, Relaxed);
                    }
                    Ok((batch, None))
                }
                // The storage's own error (a truncated shard, a failing disk) says more.
                (Err(_), Some(e)) => Err(e),
                (Err(e), None) => {
                    // Where the row group's selected chunks begin: a ShardError's `offset` (the
                    // message names the column, and the page where the decoder said one).
                    let at = super::decode::leaf_chunks(&file.table, rg, &self.per_file[fi]).map(|r| r.start).min();
                    Err(e.into_error_at(&file.name, at))
                }
            }
        })?;
        // Every row group a spilling stream uses in memory is kept: those it decodes again, and
        // those decoded before it found the projection too large for the budget (the row groups
        // an epoch ends with are still in memory when the next begins; not kept now, the epoch
        // after would decode them once more).
        if self.spills() {
            // Another stream may have kept it already: then the cache holds it loaded from its
            // file, an arena.
            if super::arena::first_view_array(&batch).and_then(super::arena::arena_of).is_some() {
                self.settle(u);
            } else {
                self.keep_later(u, fi, rg, key, &batch);
            }
        }
        Ok(batch)
    }
}

/// The footer table of the Parquet file `shown_as` of `len` bytes, read with `read_at` (fill
/// the buffer from the offset): one tail read, a second one for a footer larger than the tail.
/// Errors of `read_at` (a network failure, a short file) come back as they are.
pub fn read_table(
    shown_as: &str,
    len: u64,
    mut read_at: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<ParquetTable> {
    if len == 0 {
        return Err(Error::Shard {
            shard: shown_as.to_owned(),
            offset: None,
            reason: "is empty (0 bytes), not a Parquet file".into(),
        });
    }
    let mut io_error = None;
    let footer = footer::read_footer(len, |off, buf| {
        read_at(off, buf).map_err(|e| {
            let msg = e.to_string();
            io_error = Some(e);
            ParquetError::Io(msg)
        })
    });
    let footer = match (footer, io_error) {
        (Ok(f), _) => f,
        (Err(_), Some(e)) => return Err(e),
        (Err(e), None) => return Err(e.into_error(shown_as)),
    };
    // A file without rows is warned about once, where the dataset leaves it out.
    ParquetTable::decode(&footer, len).map_err(|e| e.into_error(shown_as))
}

/// Reads and decodes the footer of a local file: its table, or `Ok(None)` for a 0-byte file
/// (which has no footer to read; the caller names it).
pub fn open_local(file: &crate::storage::local::ShardFile) -> Result<Option<ParquetTable>> {
    if file.len == 0 {
        return Ok(None);
    }
    let footer = read_local_footer(file)?;
    ParquetTable::decode(&footer, file.len).map(Some).map_err(|e| e.into_error(&file.name))
}

/// The footer bytes of a local file (one tail read, two for a footer larger than the tail).
pub fn read_local_footer(file: &crate::storage::local::ShardFile) -> Result<Vec<u8>> {
    let mut io_error = None;
    let footer = footer::read_footer(file.len, |off, buf| {
        file.read_exact_at(buf, off).map_err(|e| {
            let msg = e.to_string();
            io_error = Some(e);
            ParquetError::Io(msg)
        })
    });
    match (footer, io_error) {
        (Ok(f), _) => Ok(f),
        (Err(_), Some(e)) => Err(e),
        (Err(e), None) => Err(e.into_error(&file.name)),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::format::parquet::footer::table_of;
    use crate::format::parquet::testdata;

    /// A node cache of one whole-file copy, its first column chunk's first page header
    /// overwritten (as a byte spoilt in transit that no page checksum covers); fetched again,
    /// `again` (none: no copy to fetch again).
    struct Copies {
        dir: tempfile::TempDir,
        again: Option<&'static str>,
        asked: Mutex<Vec<String>>,
    }

    impl Copies {
        fn new(good: &[u8], again: Option<bool>) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let mut spoilt = good.to_vec();
            spoilt[4..20].fill(0xff);
            std::fs::write(dir.path().join("good"), good).unwrap();
            std::fs::write(dir.path().join("spoilt"), &spoilt).unwrap();
            let again = again.map(|good| if good { "good" } else { "spoilt" });
            Self { dir, again, asked: Mutex::new(Vec::new()) }
        }

        fn open(&self, name: &str) -> CachedCopy {
            CachedCopy::new(std::fs::File::open(self.dir.path().join(name)).unwrap(), None).unwrap()
        }
    }

    impl FileReader for Copies {
        fn read_bytes(&self, _file: usize, _offset: u64, _len: usize) -> Result<Bytes> {
            Err(Error::Internal("read from the copy's mapping only".into()))
        }

        fn cached_copy(&self, _file: usize, _rg: usize) -> Result<Option<CachedCopy>> {
            Ok(Some(self.open("spoilt")))
        }

        fn fetch_again(&self, _file: usize, rg: usize, why: &str) -> Result<Option<CachedCopy>> {
            self.asked.lock().unwrap().push(format!("{rg}: {why}"));
            Ok(self.again.map(|name| self.open(name)))
        }
    }

    fn assembler(bytes: &[u8]) -> BatchAssembler {
        let table = Arc::new(table_of(bytes));
        let file = DatasetFile { name: "s3://b/part-0.parquet".into(), table, index: 0 };
        let (ds, _) = ParquetDataset::new(vec![file]).unwrap();
        let ds = Arc::new(ds);
        let projection = ds.projection(None).unwrap();
        BatchAssembler::new(ds, projection, Arc::new(DecodedCache::new(1 << 30)), "test").unwrap()
    }

    #[test]
    fn a_cached_copy_that_does_not_decode_is_fetched_again_once() {
        let bytes = testdata::mixed(300, 100, testdata::Codec::None);
        // Fetched again: the row group as written.
        let copies = Copies::new(&bytes, Some(true));
        let batch = assembler(&bytes).row_group(0, &copies).unwrap();
        assert_eq!(batch.num_rows(), 100);
        let asked = copies.asked.lock().unwrap().clone();
        assert_eq!(asked.len(), 1, "{asked:?}");
        assert!(asked[0].starts_with("0: "), "{asked:?}");
        // Damaged at its source (fetched again, as damaged): its error, after one more fetch.
        let copies = Copies::new(&bytes, Some(false));
        let e = assembler(&bytes).row_group(0, &copies).unwrap_err();
        assert!(matches!(e, Error::Shard { .. }) && e.to_string().contains("row group 0"), "{e}");
        assert_eq!(copies.asked.lock().unwrap().len(), 1, "fetched again once, not on and on");
        // No copy to fetch again: the error.
        let copies = Copies::new(&bytes, None);
        let e = assembler(&bytes).row_group(0, &copies).unwrap_err();
        assert!(e.to_string().contains("row group 0"), "{e}");
        // Row groups the spoilt bytes do not touch decode from the copy as it is.
        let copies = Copies::new(&bytes, None);
        assert_eq!(assembler(&bytes).row_group(1, &copies).unwrap().num_rows(), 100);
        assert!(copies.asked.lock().unwrap().is_empty());
    }
}
