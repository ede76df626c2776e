//! The partition keys of a Hive-partitioned Parquet dataset as columns
//! ([`crate::storage::partitions`] finds the files and their keys): typed as pyarrow.dataset
//! types them (`partitioning="hive"`: int32 when every value of the key reads as one, else
//! string; `__HIVE_DEFAULT_PARTITION__` is null), delivered after the files' own columns (or
//! where `fields=` puts them), one constant column per file, made when a row group is decoded.

use std::sync::Arc;

use arrow_array::{ArrayRef, Int32Array, StringArray, StringViewArray, new_null_array};
use arrow_schema::{DataType, Field};

use parquet::file::statistics::Statistics;

use super::{ParquetError, ParquetTable};
use crate::Result;
use crate::storage::partitions::{HIVE_NULL, decode_value, keys_of_all};

/// One file's value of one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyValue {
    Null,
    Int(i32),
    Str(String),
}

/// The keys of a partitioned dataset and every file's values.
#[derive(Debug, Clone, PartialEq)]
pub struct Partitions {
    fields: Vec<Field>,
    /// Per file (in the dataset's order of shards), per key.
    values: Vec<Vec<KeyValue>>,
    /// The same as the directories spell them (unescaped; None: the key's null), for checking a
    /// file's own column for a key ([`check_key_column`]): `05` is the int 5 but the string "05".
    raw: Vec<Vec<Option<String>>>,
}

impl Partitions {
    /// The partitions of a dataset whose shards are `names` (paths below `place`, as listed);
    /// None when no name has directories (the dataset is not partitioned).
    pub fn of(names: &[&str], place: &str) -> Result<Option<Self>> {
        if !names.iter().any(|n| n.contains('/')) {
            return Ok(None);
        }
        // The same keys throughout, each once (the listing checked it too; a manifest is read as
        // written).
        let pairs = keys_of_all(names, place)?;
        let keys: Vec<&str> = pairs.first().map(|p| p.iter().map(|(k, _)| *k).collect()).unwrap_or_default();
        let raw: Vec<Vec<Option<String>>> =
            pairs.iter().map(|file| file.iter().map(|(_, v)| decode_value(v)).collect()).collect();
        let ints: Vec<bool> = (0..keys.len())
            .map(|k| raw.iter().filter_map(|file| file[k].as_deref()).all(|v| int32(v).is_some()))
            .collect();
        // Keys are escaped like values (`k%20x=1` is the key "k x").
        let fields = keys
            .iter()
            .zip(&ints)
            .map(|(k, &int)| {
                let name = decode_value(k).unwrap_or_else(|| (*k).to_owned());
                Field::new(name, if int { DataType::Int32 } else { DataType::Utf8 }, true)
            })
            .collect();
        let values = raw
            .iter()
            .map(|file| {
                file.iter()
                    .zip(&ints)
                    .map(|(v, &int)| match v {
                        None => KeyValue::Null,
                        Some(v) if int => int32(v).map_or(KeyValue::Null, KeyValue::Int),
                        Some(v) => KeyValue::Str(v.clone()),
                    })
                    .collect()
            })
            .collect();
        Ok(Some(Self { fields, values, raw }))
    }

    /// File `file`'s value of key `key` as its directory spells it (None: null or no such key).
    pub fn raw_value(&self, file: usize, key: usize) -> Option<&str> {
        self.raw.get(file)?.get(key)?.as_deref()
    }

    /// The keys as columns, in directory order.
    pub fn fields(&self) -> &[Field] {
        &self.fields
    }

    /// The values of file `file` (its position among the dataset's shards), one per key.
    pub fn values(&self, file: usize) -> &[KeyValue] {
        self.values.get(file).map_or(&[], Vec::as_slice)
    }
}

/// Checks the column `name` of `table`'s file, a partition key the files hold too, against the
/// value `raw` its directory gives the key (None: null): by the footer's statistics, every row
/// group's smallest and largest value must be that value (or, for null, every value null). Integer
/// and string columns are checked; a row group without statistics, or a column of another type
/// (a date, say), is served as the file holds it, the files' columns being what is delivered.
pub fn check_key_column(table: &ParquetTable, name: &str, raw: Option<&str>) -> Result<(), ParquetError> {
    let meta = table.reader_metadata().metadata();
    let leaf = meta.file_metadata().schema_descr().columns().iter().position(|c| c.path().parts() == [name]);
    let Some(leaf) = leaf else { return Ok(()) };
    let shown = raw.unwrap_or(HIVE_NULL);
    for (i, rg) in meta.row_groups().iter().enumerate() {
        let Some(stats) = rg.column(leaf).statistics() else { continue };
        let rows = u64::try_from(rg.num_rows()).unwrap_or(0);
        let all_null = stats.null_count_opt() == Some(rows);
        let differs = |found: String| ParquetError::KeyColumnDiffers {
            column: name.to_owned(),
            value: shown.to_owned(),
            found,
            row_group: i,
        };
        if rows == 0 || (raw.is_none() && all_null) {
            continue;
        }
        let Some(raw) = raw else {
            return Err(differs("values where the directory says null".into()));
        };
        if stats.null_count_opt().is_some_and(|n| n > 0) {
            return Err(differs("nulls".into()));
        }
        let (min, max) = match stats {
            Statistics::Int32(s) => (s.min_opt().map(|v| i64::from(*v)), s.max_opt().map(|v| i64::from(*v))),
            Statistics::Int64(s) => (s.min_opt().copied(), s.max_opt().copied()),
            Statistics::ByteArray(s) => match (s.min_opt(), s.max_opt()) {
                (Some(lo), Some(hi)) if lo.data() == raw.as_bytes() && hi.data() == raw.as_bytes() => continue,
                (Some(lo), Some(hi)) => {
                    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
                    return Err(differs(range(&text(lo.data()), &text(hi.data()))));
                }
                _ => continue,
            },
            _ => return Ok(()),
        };
        let (Some(min), Some(max)) = (min, max) else { continue };
        if raw.parse::<i64>().ok() != Some(min) || min != max {
            return Err(differs(range(&min.to_string(), &max.to_string())));
        }
    }
    Ok(())
}

/// A row group's values from `lo` to `hi`, for an error.
fn range(lo: &str, hi: &str) -> String {
    if lo == hi { lo.to_owned() } else { format!("{lo} to {hi}") }
}

/// `v` as an int32 as pyarrow's inference reads one: digits with an optional `-` (`05` is 5),
/// no `+`, no blanks.
fn int32(v: &str) -> Option<i32> {
    if v.starts_with('+') {
        return None;
    }
    v.parse().ok()
}

/// A column of `rows` copies of `value`, as `data_type` (the key's type, or its view type when
/// the file's bytes columns are decoded as views).
pub fn constant_column(value: &KeyValue, rows: usize, data_type: &DataType) -> Result<ArrayRef, String> {
    Ok(match (value, data_type) {
        (KeyValue::Null, t) => new_null_array(t, rows),
        (KeyValue::Int(v), DataType::Int32) => Arc::new(Int32Array::from_value(*v, rows)),
        (KeyValue::Str(s), DataType::Utf8) => {
            // Arrow's string offsets are i32: past 2 GiB of repeated value arrow-rs panics.
            if s.len().checked_mul(rows).is_none_or(|bytes| bytes > i32::MAX as usize) {
                return Err(format!(
                    "the partition value {s:?} repeated over the row group's {rows} rows exceeds the 2 GiB an \
                     Arrow string column holds; select a flat projection (its keys are string views) or write \
                     smaller row groups"
                ));
            }
            Arc::new(StringArray::from_iter_values(std::iter::repeat_n(s, rows)))
        }
        (KeyValue::Str(s), DataType::Utf8View) => {
            Arc::new(StringViewArray::from_iter_values(std::iter::repeat_n(s, rows)))
        }
        (v, t) => return Err(format!("a partition value {v:?} cannot be a {t} column")),
    })
}

#[cfg(test)]
mod tests {
    use arrow_array::Array;

    use super::*;

    #[test]
    fn keys_are_typed_as_pyarrow_dataset_types_them() {
        let names = [
            "year=2020/region=eu%20west/a.parquet",
            "year=2021/region=us%2Feast/b.parquet",
            "year=__HIVE_DEFAULT_PARTITION__/region=__HIVE_DEFAULT_PARTITION__/c.parquet",
        ];
        let p = Partitions::of(&names, "/d/").unwrap().unwrap();
        assert_eq!(p.fields(), [Field::new("year", DataType::Int32, true), Field::new("region", DataType::Utf8, true)]);
        assert_eq!(p.values(0), [KeyValue::Int(2020), KeyValue::Str("eu west".into())]);
        assert_eq!(p.values(1), [KeyValue::Int(2021), KeyValue::Str("us/east".into())]);
        assert_eq!(p.values(2), [KeyValue::Null, KeyValue::Null]);
        // One value that is no int32 makes the key a string throughout (3000000000 overflows it).
        let big = Partitions::of(&["n=1/a.parquet", "n=3000000000/b.parquet"], "/d/").unwrap().unwrap();
        assert_eq!(big.fields()[0].data_type(), &DataType::Utf8);
        assert_eq!(big.values(0), [KeyValue::Str("1".into())]);
        assert_eq!(Partitions::of(&["a.parquet", "b.parquet"], "/d/").unwrap(), None);
        // As pyarrow infers: `05` and `-3` are ints, `+5` and ` 3` are not; keys are unescaped.
        let odd = Partitions::of(&["k%20x=05/a.parquet", "k%20x=-3/b.parquet"], "/d/").unwrap().unwrap();
        assert_eq!(odd.fields(), [Field::new("k x", DataType::Int32, true)]);
        assert_eq!((odd.values(0), odd.values(1)), (&[KeyValue::Int(5)][..], &[KeyValue::Int(-3)][..]));
        for not_int in ["+5", " 3", "1.5", ""] {
            let p = Partitions::of(&["k=1/a.parquet", &format!("k={not_int}/b.parquet")], "/d/").unwrap().unwrap();
            assert_eq!(p.fields()[0].data_type(), &DataType::Utf8, "{not_int:?}");
        }
        let e = Partitions::of(&["y=1/y=2/a.parquet"], "/d/").unwrap_err().to_string();
        assert!(e.contains("names the partition key \"y\" twice"), "{e}");
        let e = Partitions::of(&["y=1/a.parquet", "m=1/b.parquet"], "/d/").unwrap_err().to_string();
        assert!(e.contains("/d/m=1/b.parquet by m"), "{e}");
    }

    fn table_of(columns: Vec<(&str, ArrayRef)>) -> ParquetTable {
        let batch = arrow_array::RecordBatch::try_from_iter(columns).unwrap();
        let bytes = super::super::testdata::with_batch(&batch);
        let footer = super::super::footer::read_footer(bytes.len() as u64, |o, b| {
            let o = usize::try_from(o).unwrap();
            b.copy_from_slice(&bytes[o..o + b.len()]);
            Ok(())
        })
        .unwrap();
        ParquetTable::decode(&footer, bytes.len() as u64).unwrap()
    }

    #[test]
    fn a_key_column_is_checked_against_its_directory_by_the_statistics() {
        let ints: ArrayRef = Arc::new(arrow_array::Int64Array::from(vec![2020, 2020]));
        let t = table_of(vec![("year", ints)]);
        check_key_column(&t, "year", Some("2020")).unwrap();
        let e = check_key_column(&t, "year", Some("2021")).unwrap_err().to_string();
        assert!(e.contains("holds 2020 in column \"year\"") && e.contains("says year=2021"), "{e}");
        let e = check_key_column(&t, "year", None).unwrap_err().to_string();
        assert!(e.contains("year=__HIVE_DEFAULT_PARTITION__"), "{e}");
        let mixed: ArrayRef = Arc::new(Int32Array::from(vec![1, 2]));
        let e = check_key_column(&table_of(vec![("k", mixed)]), "k", Some("1")).unwrap_err().to_string();
        assert!(e.contains("holds 1 to 2"), "{e}");
        // Strings compare as written: "05" is not "5".
        let text: ArrayRef = Arc::new(StringArray::from(vec!["05", "05"]));
        let t = table_of(vec![("day", text)]);
        check_key_column(&t, "day", Some("05")).unwrap();
        assert!(check_key_column(&t, "day", Some("5")).is_err());
        // Nulls where the directory says null pass; a value there does not.
        let nulls: ArrayRef = Arc::new(StringArray::from(vec![None::<&str>, None]));
        check_key_column(&table_of(vec![("r", nulls)]), "r", None).unwrap();
        let one: ArrayRef = Arc::new(StringArray::from(vec![Some("eu"), None]));
        assert!(check_key_column(&table_of(vec![("r", one)]), "r", Some("eu")).is_err());
        // A type the statistics cannot be compared for is served as the file holds it.
        let floats: ArrayRef = Arc::new(arrow_array::Float64Array::from(vec![1.5]));
        check_key_column(&table_of(vec![("f", floats)]), "f", Some("2")).unwrap();
    }

    #[test]
    fn constant_columns_repeat_the_value_in_the_asked_type() {
        let c = constant_column(&KeyValue::Int(7), 3, &DataType::Int32).unwrap();
        assert_eq!(c.as_any().downcast_ref::<Int32Array>().unwrap().values(), &[7, 7, 7]);
        let v = constant_column(&KeyValue::Str("a long value beyond twelve".into()), 2, &DataType::Utf8View).unwrap();
        assert_eq!(v.as_any().downcast_ref::<StringViewArray>().unwrap().value(1), "a long value beyond twelve");
        let n = constant_column(&KeyValue::Null, 4, &DataType::Utf8).unwrap();
        assert_eq!(n.null_count(), 4);
        assert!(constant_column(&KeyValue::Str("x".into()), 1, &DataType::Int32).is_err());
        // 2^31 bytes of a key over a large row group: an error, not arrow-rs's offset panic
        // (checked before anything is allocated).
        let long = KeyValue::Str("k".repeat(256));
        let e = constant_column(&long, 1 << 23, &DataType::Utf8).unwrap_err();
        assert!(e.contains("2 GiB"), "{e}");
        assert!(constant_column(&long, usize::MAX, &DataType::Utf8).is_err());
    }
}
