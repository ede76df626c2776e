//! The dataset's schema and the projection of the selected fields.
//!
//! The dataset's schema is its first file's (as pyarrow and Hugging Face `datasets` take it).
//! `fields` selects top-level columns (None = all, in file order; a list keeps its own order, as
//! pyarrow's `columns=` does). Every file must have every selected column with the same Arrow type
//! (nested field names such as a list's `item`/`element` aside), a narrower one that widens to it
//! without loss ([`super::widen`]), or none at all (pandas' column of Nones: delivered as nulls);
//! a file that does not is named, with the column, when the dataset is opened, never mid-epoch. A column that is nullable in any
//! file is nullable in the delivered schema. A partitioned dataset's keys ([`super::partitions`])
//! are selected like columns and come after the files' own in "all"; no file may have a column
//! named like a key; a key's column is made from the file's value, never read.
//!
//! When every selected column is flat (what [`super::direct`] writes), binary and string columns
//! are decoded as views (`BinaryView`/`Utf8View`): arrow-rs then points each value into the
//! decompressed page (or, uncompressed, the bytes read from the file) and into a dictionary page's
//! values, where decoding into `Binary`/`Utf8` copied every value once more, and again each time
//! its growing buffer was reallocated (a third of a cold epoch's daemon time on the bench's image
//! set, bench/PARQUET_PROFILE.md). The views stay inside the daemon's decoded row groups: the
//! direct writer turns them back into the delivered type as it copies each row into the batch.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};

use super::partitions::KeyValue;
use super::{ParquetError, ParquetTable, strings};

/// The selected columns of a dataset, as delivered.
#[derive(Debug, Clone)]
pub struct Projection {
    schema: SchemaRef,
    /// For each delivered column: the partition key it is (its position among the dataset's
    /// keys, [`super::partitions`]), None for a column of the files.
    keys: Vec<Option<usize>>,
    /// Every partition key the files have no column for, by name: no file may have one.
    key_names: Vec<String>,
    /// The partition keys the first file has as columns too (as Polars writes partitions), by
    /// position among the dataset's keys and name: served from the files' columns, which every
    /// file must have ([`Self::key_columns`]).
    key_columns: Vec<(usize, String)>,
}

/// Where a delivered column comes from in one file.
#[derive(Debug, Clone)]
enum Source {
    /// The decoded column at this position (the decoder yields file order).
    Decoded(usize),
    /// The file's value of a partition key, the same in every row.
    Key(KeyValue),
}

/// How to read a [`Projection`] out of one file: the column chunks to decode, and the order to
/// put the decoded columns in.
#[derive(Debug, Clone)]
pub struct FileProjection {
    pub mask: ProjectionMask,
    /// Where each output column comes from.
    reorder: Vec<Source>,
    /// Whether no column chunk is read (only partition keys are selected).
    reads_nothing: bool,
    /// The decoded row groups' schema: the delivered one, with views for bytes columns when
    /// `views` is set.
    schema: SchemaRef,
    /// Whether bytes columns are decoded as views (see the module docs).
    views: bool,
    /// The file's reader metadata with the types to decode as: views, and strings the file does
    /// not mark as UTF8 as bytes ([`super::strings`]); None: as the file says.
    decode: Option<ArrowReaderMetadata>,
    /// For each delivered column: whether it is checked as a whole after decoding (strings that
    /// arrow-rs decodes as strings without checking them: JSON leaves).
    check: Vec<bool>,
}

impl Projection {
    /// The projection of `fields` (None = all) of the dataset whose first file has `first`'s
    /// schema and whose directories give the partition keys `keys` (none when it is not
    /// partitioned): all is the files' columns, then the keys, as pyarrow.dataset orders them. A
    /// key the first file has as a column is that column (Polars writes partitions so; pyarrow
    /// fails on them).
    pub fn new(first: &Schema, keys: &[Field], fields: Option<&[String]>) -> Result<Self, ParquetError> {
        let columns = ByName::new(first);
        let in_files = |k: &Field| columns.index.contains_key(k.name().as_str());
        let key_at = |name: &str| keys.iter().position(|k| k.name() == name && !in_files(k));
        let mut picked: Vec<(Field, Option<usize>)> = match fields {
            None => {
                let mut all = first
                    .fields()
                    .iter()
                    .map(|f| columns.one(f.name()).map(|(_, f)| (f.clone(), None)))
                    .collect::<Result<Vec<_>, _>>()?;
                all.extend(keys.iter().enumerate().filter(|(_, k)| !in_files(k)).map(|(i, k)| (k.clone(), Some(i))));
                all
            }
            Some(names) => {
                let mut out: Vec<(Field, Option<usize>)> = Vec::with_capacity(names.len());
                for n in names {
                    if out.iter().any(|(f, _)| f.name() == n) {
                        continue;
                    }
                    out.push(match key_at(n) {
                        Some(i) => (keys[i].clone(), Some(i)),
                        None => (columns.one(n).map_err(|e| with_keys(e, keys))?.1.clone(), None),
                    });
                }
                out
            }
        };
        if let Some((f, _)) = picked.iter().find(|(f, _)| f.name() == super::dataset::ROW_COLUMN) {
            return Err(ParquetError::ReservedColumn { column: f.name().clone() });
        }
        let key_of = picked.iter().map(|(_, k)| *k).collect();
        let fields: Vec<Field> = picked.drain(..).map(|(f, _)| f).collect();
        Ok(Self {
            schema: Arc::new(Schema::new_with_metadata(fields, first.metadata().clone())),
            keys: key_of,
            key_names: keys.iter().filter(|k| !in_files(k)).map(|k| k.name().clone()).collect(),
            key_columns: keys
                .iter()
                .enumerate()
                .filter(|(_, k)| in_files(k))
                .map(|(i, k)| (i, k.name().clone()))
                .collect(),
        })
    }

    /// The partition keys served from the files' own columns: (position among the dataset's
    /// keys, name).
    pub fn key_columns(&self) -> &[(usize, String)] {
        &self.key_columns
    }

    /// The schema of every batch delivered.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.schema.fields().iter().map(|f| f.name().as_str())
    }

    /// Checks that `table`'s file has every selected column with the dataset's type (or one that
    /// converts to it without loss, [`super::widen`], or with no type: all nulls), and widens the
    /// delivered nullability (nested children's included) to the file's.
    pub fn agree(&mut self, table: &ParquetTable) -> Result<(), ParquetError> {
        let file = table.schema();
        let mut changed = false;
        let mut fields: Vec<Field> = Vec::with_capacity(self.schema.fields().len());
        let columns = ByName::new(file);
        if let Some(k) = self.key_names.iter().find(|k| columns.index.contains_key(k.as_str())) {
            return Err(ParquetError::KeyColumnInSome { column: k.clone(), here: true });
        }
        if let Some((_, k)) = self.key_columns.iter().find(|(_, k)| !columns.index.contains_key(k.as_str())) {
            return Err(ParquetError::KeyColumnInSome { column: k.clone(), here: false });
        }
        for (want, key) in self.schema.fields().iter().zip(&self.keys) {
            if key.is_some() {
                fields.push(want.as_ref().clone());
                continue;
            }
            let (_, got) = columns.one(want.name())?;
            // A column with no type here (pandas' for one that is None throughout the file) is
            // delivered as nulls of the dataset's type ([`FileProjection::arrange`]), as
            // pyarrow.dataset reads it.
            let t = super::widen::join(got.data_type(), want.data_type()).map_err(|m| {
                let hint = match want.data_type() {
                    DataType::Null => {
                        " (every value of it there is None, written without a type: write every file \
                         with the dataset's schema, e.g. pyarrow's write_table(table.cast(schema)) or pandas' \
                         to_parquet(schema=...), or leave the column out with fields=[...])"
                    }
                    _ => "",
                };
                ParquetError::TypeMismatch {
                    column: format!("{}{}", want.name(), m.path),
                    expected: m.expected.to_string(),
                    found: m.found.to_string(),
                    hint,
                }
            })?;
            let nullable = want.is_nullable() || got.is_nullable();
            changed |= nullable != want.is_nullable() || &t != want.data_type();
            fields.push(want.as_ref().clone().with_data_type(t).with_nullable(nullable));
        }
        if changed {
            self.schema = Arc::new(Schema::new_with_metadata(fields, self.schema.metadata().clone()));
        }
        Ok(())
    }

    /// Names every delivered column that may hold a null in some file of `files` (each with its
    /// partition keys' values, whose agreement was checked) under [`super::nulls::KEY`] in the
    /// schema's metadata ([`super::nulls`]), replacing what the first file's metadata held there
    /// (a file written from batches shardstream delivered).
    pub fn mark_nulls<'t>(&mut self, files: impl IntoIterator<Item = (&'t ParquetTable, &'t [KeyValue])>) {
        let mut possible = vec![false; self.keys.len()];
        for (table, values) in files {
            let columns = ByName::new(table.schema());
            for ((p, field), key) in possible.iter_mut().zip(self.schema.fields()).zip(&self.keys) {
                *p = *p
                    || match key {
                        Some(k) => matches!(values.get(*k), None | Some(KeyValue::Null)),
                        // `agree` found each column once in every file.
                        None => columns.one(field.name()).map_or(true, |(root, _)| super::nulls::may_hold(table, root)),
                    };
            }
        }
        let names: Vec<&str> =
            self.names().zip(possible).filter_map(|(name, possible)| possible.then_some(name)).collect();
        let mut meta = self.schema.metadata().clone();
        // A list of strings always serializes.
        meta.insert(super::nulls::KEY.to_owned(), serde_json::to_string(&names).unwrap_or_else(|_| "[]".into()));
        self.schema = Arc::new(Schema::new_with_metadata(self.schema.fields().clone(), meta));
    }

    /// How to read this projection out of `table`'s file (whose agreement was checked), whose
    /// partition keys have the values `values` (none when the dataset is not partitioned).
    pub fn for_file(&self, table: &ParquetTable, values: &[KeyValue]) -> Result<FileProjection, ParquetError> {
        let file = table.schema();
        let columns = ByName::new(file);
        // Each delivered column: the file's root column it is read from (its place among the
        // decoded columns once all are known), or a key's value.
        let mut reorder = (self.schema.fields().iter().zip(&self.keys))
            .map(|(want, key)| match key {
                Some(k) => Ok(Source::Key(values.get(*k).cloned().unwrap_or(KeyValue::Null))),
                None => columns.one(want.name()).map(|(root, _)| Source::Decoded(root)),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut sorted: Vec<usize> =
            reorder.iter().filter_map(|s| if let Source::Decoded(r) = s { Some(*r) } else { None }).collect();
        sorted.sort_unstable();
        let leaves = strings::Leaves::of(table.reader_metadata().parquet_schema());
        let check =
            reorder.iter().map(|s| matches!(s, Source::Decoded(r) if leaves.json.get(*r) == Some(&true))).collect();
        for s in &mut reorder {
            if let Source::Decoded(r) = s {
                *r = sorted.partition_point(|c| c < r);
            }
        }
        let reads_nothing = sorted.is_empty();
        let mask = ProjectionMask::roots(table.reader_metadata().parquet_schema(), sorted);
        check_codecs(table, &mask)?;
        let flat = self.schema.fields().iter().all(|f| super::direct::is_flat(f.data_type()));
        let (decode, mut views) = decode_metadata(table, &leaves, flat)?;
        // A file without a bytes column of its own has none to decode as views; when the
        // projection has some, this file holds them typeless (`agree`), and delivers them as
        // nulls of the view type like every other file's views.
        if !views && flat && file.fields().iter().all(|f| view_type(f.data_type()).is_none()) {
            views = self.schema.fields().iter().any(|f| view_type(f.data_type()).is_some());
        }
        let schema = if views { with_views(&self.schema) } else { self.schema.clone() };
        Ok(FileProjection { mask, reorder, reads_nothing, schema, views, decode, check })
    }
}

/// `t` with its bytes types, at the top or inside structs, as views; None when it has none.
fn view_type(t: &DataType) -> Option<DataType> {
    match t {
        DataType::Binary | DataType::LargeBinary => Some(DataType::BinaryView),
        DataType::Utf8 | DataType::LargeUtf8 => Some(DataType::Utf8View),
        DataType::Struct(fields) if fields.iter().any(|f| view_type(f.data_type()).is_some()) => {
            Some(DataType::Struct(fields.iter().map(|f| Arc::new(with_view(f))).collect()))
        }
        _ => None,
    }
}

fn with_view(f: &Field) -> Field {
    match view_type(f.data_type()) {
        Some(v) => f.clone().with_data_type(v),
        None => f.clone(),
    }
}

/// `schema` with its bytes columns (and struct children) as views.
fn with_views(schema: &Schema) -> SchemaRef {
    let fields: Vec<Field> = schema.fields().iter().map(|f| with_view(f)).collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

/// The reader metadata to decode `table` with, and whether its bytes columns are views: as views
/// when every selected column is `flat` and arrow-rs takes the hint (else as delivered), with the
/// strings the file does not mark as UTF8 as bytes ([`super::strings`]). None:
/// the file's own.
fn decode_metadata(
    table: &ParquetTable,
    leaves: &strings::Leaves,
    flat: bool,
) -> Result<(Option<ArrowReaderMetadata>, bool), ParquetError> {
    let file = table.schema();
    let strings_as_bytes = |schema: &Schema| {
        let fields: Vec<Field> = (schema.fields().iter().enumerate())
            .map(|(i, f)| match strings::as_bytes(f.data_type(), leaves.unmarked.get(i).map_or(&[], Vec::as_slice)) {
                Some(t) => f.as_ref().clone().with_data_type(t),
                None => f.as_ref().clone(),
            })
            .collect();
        Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
    };
    let with_schema = |schema: SchemaRef| {
        let options = ArrowReaderOptions::new().with_schema(schema);
        ArrowReaderMetadata::try_new(table.reader_metadata().metadata().clone(), options)
    };
    if flat && file.fields().iter().any(|f| view_type(f.data_type()).is_some()) {
        match with_schema(strings_as_bytes(&with_views(file))) {
            Ok(m) => return Ok((Some(m), true)),
            Err(e) => tracing::debug!(error = %e, "bytes columns decoded without views"),
        }
    }
    let decoded = strings_as_bytes(file);
    if decoded == *file {
        return Ok((None, false));
    }
    let m = with_schema(decoded).map_err(|e| {
        ParquetError::BadFooter(format!("strings not marked UTF8 in the Parquet schema cannot be read as bytes: {e}"))
    })?;
    Ok((Some(m), false))
}

impl FileProjection {
    /// The reader metadata to decode with (views or as delivered; see the module docs).
    pub fn reader_metadata<'a>(&'a self, table: &'a ParquetTable) -> &'a ArrowReaderMetadata {
        self.decode.as_ref().unwrap_or_else(|| table.reader_metadata())
    }

    /// Whether bytes columns are decoded as views.
    pub fn views(&self) -> bool {
        self.views
    }

    /// The decoded row groups' schema (see [`Self::arrange`]).
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Whether no column chunk is read: only partition keys are selected, and a row group's
    /// rows are its row count.
    pub fn reads_nothing(&self) -> bool {
        self.reads_nothing
    }
}

impl FileProjection {
    /// A decoded batch (columns in file order) as the delivered columns, in the delivered order
    /// and schema (with views for bytes columns when [`Self::views`]); strings decoded as bytes
    /// are checked and typed as strings again.
    pub fn arrange(&self, decoded: &RecordBatch) -> Result<RecordBatch, ParquetError> {
        let bad = |reason: String| ParquetError::BadData { row_group: 0, reason };
        let mut cols = (self.reorder.iter().zip(self.schema.fields()))
            .map(|(source, field)| match source {
                Source::Decoded(i) => {
                    decoded.columns().get(*i).cloned().ok_or_else(|| bad("the decoder lost a column".into()))
                }
                Source::Key(v) => {
                    super::partitions::constant_column(v, decoded.num_rows(), field.data_type()).map_err(bad)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        for ((col, field), &check) in cols.iter_mut().zip(self.schema.fields()).zip(&self.check) {
            let named = |e: arrow_schema::ArrowError| bad(format!("column {:?}: {e}", field.name()));
            if col.data_type() != field.data_type() {
                // Only a file that differs from the dataset pays for the conversion (a column
                // with no type, a narrower one, strings decoded as bytes: see `Projection::agree`).
                let from = col.data_type().clone();
                *col = super::widen::convert(col, field.data_type()).map_err(|e| {
                    match super::widen::unfit_reason(&e) {
                        // Values the dataset's type cannot hold: the file is sound, the files disagree.
                        Some(m) => ParquetError::Unfit {
                            row_group: 0,
                            reason: format!(
                                "column {:?} holds values of its {from} that the dataset's {} cannot: {m}",
                                field.name(),
                                field.data_type()
                            ),
                        },
                        None => named(e),
                    }
                })?;
            }
            if check {
                strings::check(col).map_err(named)?;
            }
        }
        let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(decoded.num_rows()));
        RecordBatch::try_new_with_options(self.schema.clone(), cols, &options).map_err(|e| ParquetError::BadData {
            row_group: 0,
            reason: format!("decoded columns do not match the dataset schema: {e}"),
        })
    }
}

/// Refuses, before any batch, a selected column chunk whose codec this build cannot decode (lz4,
/// brotli, lzo: only snappy, zstd, gzip and none are built in; a
/// `ValueError`-kind error naming the column and codec, not a corrupt-data error mid-epoch).
fn check_codecs(table: &ParquetTable, mask: &ProjectionMask) -> Result<(), ParquetError> {
    use parquet::basic::Compression;
    for rg in table.reader_metadata().metadata().row_groups() {
        for (i, c) in rg.columns().iter().enumerate() {
            if !mask.leaf_included(i) {
                continue;
            }
            match c.compression() {
                Compression::UNCOMPRESSED | Compression::SNAPPY | Compression::ZSTD(_) | Compression::GZIP(_) => {}
                other => {
                    return Err(ParquetError::UnsupportedCodec {
                        column: c.column_path().string(),
                        codec: other.to_string(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// A schema's columns by name, indexed once: every stream's projection looks up each selected
/// column in every file, and a wide table (thousands of columns) over many files made a linear
/// search per lookup a cost of each stream's start.
struct ByName<'a> {
    schema: &'a Schema,
    /// Each name's first column, and how many columns have it.
    index: HashMap<&'a str, (usize, usize)>,
}

impl<'a> ByName<'a> {
    fn new(schema: &'a Schema) -> Self {
        let mut index: HashMap<&str, (usize, usize)> = HashMap::with_capacity(schema.fields().len());
        for (i, f) in schema.fields().iter().enumerate() {
            index.entry(f.name().as_str()).or_insert((i, 0)).1 += 1;
        }
        Self { schema, index }
    }

    /// The one column named `name`, and its index: an error when there is none, or more than one
    /// (Arrow schemas may repeat a name; which one a name selects cannot be told).
    fn one(&self, name: &str) -> Result<(usize, &'a Field), ParquetError> {
        match self.index.get(name) {
            None => Err(missing(self.schema, name)),
            Some(&(i, 1)) => Ok((i, self.schema.field(i))),
            Some(&(_, count)) => Err(ParquetError::DuplicateColumn { column: name.to_string(), count }),
        }
    }
}

/// A missing column's error listing the partition keys beside the files' columns.
fn with_keys(e: ParquetError, keys: &[Field]) -> ParquetError {
    match e {
        ParquetError::MissingColumn { column, mut available } if !keys.is_empty() => {
            let keys: Vec<&str> = keys.iter().map(|k| k.name().as_str()).collect();
            available.push_str(&format!("; partition keys: {}", keys.join(", ")));
            ParquetError::MissingColumn { column, available }
        }
        e => e,
    }
}

fn missing(schema: &Schema, column: &str) -> ParquetError {
    let available = schema.fields().iter().map(|f| f.name().as_str()).collect::<Vec<_>>().join(", ");
    ParquetError::MissingColumn { column: column.to_string(), available }
}

#[cfg(test)]
mod tests {
    use arrow_array::{Int32Array, Int64Array};
    use arrow_schema::DataType;

    use super::super::testdata;
    use super::*;

    use super::super::footer::table_of as table;

    fn names(p: &Projection) -> Vec<&str> {
        p.names().collect()
    }

    #[test]
    fn selection_keeps_the_requested_order_and_all_means_file_order() {
        let t = table(&testdata::mixed(10, 5, testdata::Codec::None));
        let all = Projection::new(t.schema(), &[], None).unwrap();
        assert_eq!(names(&all), ["id", "label", "caption", "image", "blob", "text", "tokens"]);
        let sel: Vec<String> = ["text", "id"].map(String::from).to_vec();
        let p = Projection::new(t.schema(), &[], Some(&sel)).unwrap();
        assert_eq!(names(&p), ["text", "id"]);
        assert_eq!(p.schema().field(0).data_type(), &DataType::LargeUtf8);
        let e = Projection::new(t.schema(), &[], Some(&["nope".to_string()])).unwrap_err();
        let msg = e.into_error("a.parquet").to_string();
        assert!(msg.contains("a.parquet") && msg.contains("\"nope\"") && msg.contains("caption"), "{msg}");
    }

    #[test]
    fn a_name_given_to_two_columns_selects_neither() {
        let s = Schema::new(vec![
            Field::new("x", DataType::Int64, false),
            Field::new("s", DataType::Utf8, false),
            Field::new("x", DataType::Int32, false),
        ]);
        assert!(matches!(Projection::new(&s, &[], None), Err(ParquetError::DuplicateColumn { count: 2, .. })));
        let x = Projection::new(&s, &[], Some(&["s".to_string(), "x".to_string()]));
        assert!(matches!(x, Err(ParquetError::DuplicateColumn { column, .. }) if column == "x"));
        assert_eq!(names(&Projection::new(&s, &[], Some(&["s".to_string()])).unwrap()), ["s"]);
    }

    #[test]
    fn a_file_without_a_column_or_with_another_type_is_named() {
        let first = table(&testdata::mixed(10, 5, testdata::Codec::None));
        let sel: Vec<String> = vec!["id".into(), "label".into()];
        let mut p = Projection::new(first.schema(), &[], Some(&sel)).unwrap();
        // Same names, label as int64: a type mismatch, an InvalidArgument naming file and column.
        let s = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("label", DataType::Int64, false),
        ]));
        let b = RecordBatch::try_new(s, vec![Arc::new(Int64Array::from(vec![1])), Arc::new(Int64Array::from(vec![2]))])
            .unwrap();
        let e = p.agree(&table(&testdata::with_batch(&b))).unwrap_err().into_error("b.parquet");
        assert!(
            matches!(&e, crate::Error::InvalidArgument(m) if m.contains("b.parquet") && m.contains("\"label\"") && m.contains("Int32")),
            "{e}"
        );
        // Without the column at all.
        let s = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
        let b = RecordBatch::try_new(s, vec![Arc::new(Int64Array::from(vec![1]))]).unwrap();
        let e = p.agree(&table(&testdata::with_batch(&b))).unwrap_err().into_error("c.parquet");
        assert!(
            matches!(&e, crate::Error::InvalidArgument(m) if m.contains("c.parquet") && m.contains("\"label\"")),
            "{e}"
        );
        // id nullable in another file: the delivered id becomes nullable; unselected columns of
        // other types do not matter.
        let s = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("label", DataType::Int32, true),
            Field::new("caption", DataType::Int32, true),
        ]));
        let b = RecordBatch::try_new(
            s,
            vec![
                Arc::new(Int64Array::from(vec![1])),
                Arc::new(Int32Array::from(vec![2])),
                Arc::new(Int32Array::from(vec![3])),
            ],
        )
        .unwrap();
        assert!(!p.schema().field(0).is_nullable());
        p.agree(&table(&testdata::with_batch(&b))).unwrap();
        assert!(p.schema().field(0).is_nullable());
    }

    #[test]
    fn columns_and_keys_that_may_hold_a_null_are_marked_and_nothing_else() {
        use super::super::nulls::KEY;
        let t = table(&testdata::mixed(40, 16, testdata::Codec::Snappy));
        let keys = [Field::new("year", DataType::Int32, true), Field::new("region", DataType::Utf8, true)];
        let marked = |p: &Projection| -> Vec<String> {
            serde_json::from_str(p.schema().metadata().get(KEY).expect("always named")).unwrap()
        };
        let mut p = Projection::new(t.schema(), &keys, None).unwrap();
        let (a, b) = ([KeyValue::Int(2021), KeyValue::Str("eu".into())], [KeyValue::Int(2022), KeyValue::Null]);
        // label, caption and tokens have nulls in the rows written; region is null in one directory.
        p.mark_nulls([(&t, &a[..]), (&t, &b[..])]);
        assert_eq!(marked(&p), ["label", "caption", "tokens", "region"]);
        p.mark_nulls([(&t, &a[..])]);
        assert_eq!(marked(&p), ["label", "caption", "tokens"], "named again from other files, not kept");
        // The file's own metadata stays beside the names; a stale list of its own is replaced.
        let first = t.schema().as_ref().clone();
        let meta = HashMap::from([("k".to_string(), "v".to_string()), (KEY.to_string(), r#"["id"]"#.to_string())]);
        let mut p = Projection::new(&first.with_metadata(meta), &[], Some(&["id".to_string()])).unwrap();
        p.mark_nulls([(&t, &[][..])]);
        assert_eq!(p.schema().metadata().get("k").map(String::as_str), Some("v"));
        assert!(marked(&p).is_empty());
    }
}
