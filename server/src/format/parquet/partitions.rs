//! The partition keys of a Hive-partitioned Parquet dataset as columns
//! ([`crate::storage::partitions`] finds the files and their keys): typed as pyarrow.dataset
//! types them (`partitioning="hive"`: int32 when every value of the key reads as one, else
//! string; `__HIVE_DEFAULT_PARTITION__` is null), delivered after the files' own columns (or
//! where `fields=` puts them), one constant column per file, made when a row group is decoded.

use std::sync::Arc;

use arrow_array::{ArrayRef, Int32Array, StringArray, StringViewArray, new_null_array};
use arrow_schema::{DataType, Field};

use crate::Result;
use crate::storage::partitions::{decode_value, keys_of_all};

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
            .into_iter()
            .map(|file| {
                file.into_iter()
                    .zip(&ints)
                    .map(|(v, &int)| match v {
                        None => KeyValue::Null,
                        Some(v) if int => int32(&v).map_or(KeyValue::Null, KeyValue::Int),
                        Some(v) => KeyValue::Str(v),
                    })
                    .collect()
            })
            .collect();
        Ok(Some(Self { fields, values }))
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
        (KeyValue::Str(s), DataType::Utf8) => Arc::new(StringArray::from_iter_values(std::iter::repeat_n(s, rows))),
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

    #[test]
    fn constant_columns_repeat_the_value_in_the_asked_type() {
        let c = constant_column(&KeyValue::Int(7), 3, &DataType::Int32).unwrap();
        assert_eq!(c.as_any().downcast_ref::<Int32Array>().unwrap().values(), &[7, 7, 7]);
        let v = constant_column(&KeyValue::Str("a long value beyond twelve".into()), 2, &DataType::Utf8View).unwrap();
        assert_eq!(v.as_any().downcast_ref::<StringViewArray>().unwrap().value(1), "a long value beyond twelve");
        let n = constant_column(&KeyValue::Null, 4, &DataType::Utf8).unwrap();
        assert_eq!(n.null_count(), 4);
        assert!(constant_column(&KeyValue::Str("x".into()), 1, &DataType::Int32).is_err());
    }
}
