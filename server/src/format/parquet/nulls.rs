//! Which delivered columns may hold a null somewhere in the dataset, known when it is opened.
//!
//! A reader in Python picks a column's form by whether it has nulls (a numpy array, or a
//! `MaskedArray` when some are null). Decided batch by batch, a column with a few nulls changed
//! form from one batch to the next, and `shardstream.torch` handed out a tensor in some batches
//! and a `MaskedArray` in others. Every column chunk's statistics count its nulls, and the footers
//! are read anyway: a column is null-free when every row group of every file has statistics for
//! every leaf of it that count none. Anything less (a file written without statistics, a column a
//! file holds without a type, a partition key whose directory says null) leaves it *possible*.
//! The delivered schema names the possible columns in its metadata, under [`KEY`], as a JSON list
//! of column names (pyarrow's `schema.metadata`; always present, `[]` when there are none), and
//! the Python client gives those columns their null-aware form in every batch. One schema-level
//! entry, not a mark on each field: every message carries the schema, and a field's metadata
//! entry made a wide table's schema message twice as long (56 against 120 KB for 1,000 float
//! columns, pyarrow's `schema.serialize()`).
//!
//! Statistics only decide the form, never the values: a batch whose column has nulls is masked
//! whatever the mark says, so a file whose statistics are wrong changes a column's form, never
//! what it holds. A leaf's nulls inside a list (a null element) mark its root column too, which
//! only ever errs towards the null-aware form.

use super::ParquetTable;

/// The schema metadata key naming the columns that may hold a null (a JSON list of names).
pub const KEY: &str = "shardstream.nulls";

/// Whether root column `root` (its position among the file's top-level columns) of `table` may
/// hold a null: true unless every row group with rows has statistics counting no nulls for
/// every leaf under it.
pub fn may_hold(table: &ParquetTable, root: usize) -> bool {
    let meta = table.reader_metadata().metadata();
    let descr = meta.file_metadata().schema_descr();
    // A root's leaves are consecutive (the schema is walked depth first): found by two binary
    // searches, since every stream's start asks this of each selected column in every file, and
    // a wide table has thousands of leaves.
    let first_leaf_of = |root: usize| {
        let (mut lo, mut hi) = (0, descr.num_columns());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if descr.get_column_root_idx(mid) < root {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    };
    let leaves = first_leaf_of(root)..first_leaf_of(root + 1);
    if leaves.is_empty() {
        return true;
    }
    meta.row_groups().iter().filter(|rg| rg.num_rows() > 0).any(|rg| {
        leaves
            .clone()
            .any(|l| rg.columns().get(l).and_then(|c| c.statistics()).and_then(|s| s.null_count_opt()) != Some(0))
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Float32Array, Int64Array, ListArray, RecordBatch};
    use arrow_schema::{DataType, Field, Schema};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::{EnabledStatistics, WriterProperties};

    use super::*;

    fn table(batch: &RecordBatch, stats: EnabledStatistics) -> ParquetTable {
        let props =
            WriterProperties::builder().set_statistics_enabled(stats).set_max_row_group_row_count(Some(2)).build();
        let mut out = Vec::new();
        let mut w = ArrowWriter::try_new(&mut out, batch.schema(), Some(props)).unwrap();
        w.write(batch).unwrap();
        w.close().unwrap();
        super::super::footer::table_of(&out)
    }

    fn batch() -> RecordBatch {
        let list = ListArray::from_iter_primitive::<arrow_array::types::Int64Type, _, _>([
            Some(vec![Some(1)]),
            Some(vec![Some(2), None]),
            Some(vec![]),
            Some(vec![Some(3)]),
        ]);
        let cols: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(vec![1, 2, 3, 4])),
            // Null in the second row group only.
            Arc::new(Float32Array::from(vec![Some(1.0), Some(2.0), None, Some(4.0)])),
            Arc::new(list),
        ];
        let schema = Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("x", DataType::Float32, true),
            Field::new("l", cols[2].data_type().clone(), true),
        ]);
        RecordBatch::try_new(Arc::new(schema), cols).unwrap()
    }

    #[test]
    fn a_column_is_null_free_only_when_every_row_group_counts_none() {
        let t = table(&batch(), EnabledStatistics::Chunk);
        assert_eq!(t.num_row_groups(), 2);
        // Declared nullable, as pyarrow declares every column, but none is null.
        assert!(!may_hold(&t, 0));
        assert!(may_hold(&t, 1), "a null in the second row group marks the column");
        assert!(may_hold(&t, 2), "a null element inside the lists marks the list column");
    }

    #[test]
    fn without_statistics_every_column_may_hold_nulls() {
        let t = table(&batch(), EnabledStatistics::None);
        assert!((0..3).all(|c| may_hold(&t, c)));
        assert!(may_hold(&t, 7), "a root the file does not have is never called null-free");
    }

    #[test]
    fn each_root_is_judged_by_its_own_leaves_alone() {
        // Nested columns between flat ones: the struct's and the list's leaves sit between `a` and `b`.
        let inner = Field::new("item", DataType::Int64, true);
        let point = arrow_schema::Fields::from(vec![
            Field::new("x", DataType::Int64, true),
            Field::new("y", DataType::Int64, true),
        ]);
        let schema = Schema::new(vec![
            Field::new("a", DataType::Int64, true),
            Field::new("p", DataType::Struct(point.clone()), true),
            Field::new("l", DataType::List(Arc::new(inner)), true),
            Field::new("b", DataType::Int64, true),
        ]);
        let p = arrow_array::StructArray::new(
            point,
            vec![Arc::new(Int64Array::from(vec![1, 2])), Arc::new(Int64Array::from(vec![Some(3), None]))],
            None,
        );
        let l = ListArray::from_iter_primitive::<arrow_array::types::Int64Type, _, _>([
            Some(vec![Some(1)]),
            Some(vec![Some(2)]),
        ]);
        let cols: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(vec![1, 2])),
            Arc::new(p),
            Arc::new(l),
            Arc::new(Int64Array::from(vec![Some(1), None])),
        ];
        let t = table(&RecordBatch::try_new(Arc::new(schema), cols).unwrap(), EnabledStatistics::Chunk);
        assert_eq!([0, 1, 2, 3].map(|c| may_hold(&t, c)), [false, true, false, true]);
    }
}
