//! String columns whose Parquet type does not say UTF8.
//!
//! arrow-rs checks UTF-8 only in byte-array columns whose Parquet converted type is UTF8. A
//! column can be a string to Arrow without that: the file's embedded Arrow schema
//! (`ARROW:schema`, which arrow-rs follows) may say string over a byte array the Parquet schema
//! leaves unmarked, or the column is marked JSON (a string to arrow-rs). arrow-rs then builds
//! string arrays out of whatever bytes the pages hold (unchecked in release builds, a panic in
//! debug ones), and the daemon would deliver strings that are not UTF-8: a garbage row where a
//! damaged page must be an error.
//!
//! So an unmarked leaf that Arrow calls a string is decoded as bytes ([`as_bytes`]: the same
//! layout, which arrow-rs accepts for a leaf it would read as bytes itself) and given its string
//! type back after decoding ([`retype`]), which checks every value. A JSON leaf, which arrow-rs
//! reads only as a string, is checked after decoding ([`Leaves::json`]). Files that mark their strings (pyarrow, arrow-rs, Spark, DuckDB all do) are
//! decoded as before.

use std::sync::Arc;

use arrow_array::{ArrayRef, make_array};
use arrow_data::ArrayData;
use arrow_schema::{ArrowError, DataType, FieldRef};
use parquet::basic::{ConvertedType, Type as PhysicalType};
use parquet::schema::types::SchemaDescriptor;

/// The byte-array leaves of a file whose strings arrow-rs does not check, by root column.
pub struct Leaves {
    /// For each root column, for each of its leaves in order: whether the leaf is a byte array
    /// arrow-rs reads as bytes unless a hint says string (not marked UTF8 or JSON).
    pub unmarked: Vec<Vec<bool>>,
    /// For each root column: whether a leaf under it is a byte array marked JSON.
    pub json: Vec<bool>,
}

impl Leaves {
    pub fn of(descr: &SchemaDescriptor) -> Self {
        let roots = descr.root_schema().get_fields().len();
        let (mut unmarked, mut json) = (vec![Vec::new(); roots], vec![false; roots]);
        for (i, c) in descr.columns().iter().enumerate() {
            let root = descr.get_column_root_idx(i);
            let bytes = c.physical_type() == PhysicalType::BYTE_ARRAY;
            let marked = matches!(c.converted_type(), ConvertedType::UTF8 | ConvertedType::JSON);
            if let Some(leaves) = unmarked.get_mut(root) {
                leaves.push(bytes && !marked);
            }
            if bytes
                && c.converted_type() == ConvertedType::JSON
                && let Some(j) = json.get_mut(root)
            {
                *j = true;
            }
        }
        Self { unmarked, json }
    }
}

/// `t`, a root column's type whose leaves are `unmarked`'s (in the order of the Parquet
/// schema, which is Arrow's depth first), with the strings at unmarked leaves as the byte types
/// of the same layout; None when there are none. arrow-rs reads a leaf marked UTF8 only as a
/// string, so the others stay as they are.
pub fn as_bytes(t: &DataType, unmarked: &[bool]) -> Option<DataType> {
    let mut leaves = unmarked.iter().copied();
    let (t, changed) = bytes_at(t, &mut leaves);
    changed.then_some(t)
}

fn bytes_at(t: &DataType, leaves: &mut impl Iterator<Item = bool>) -> (DataType, bool) {
    let mut field = |f: &FieldRef| {
        let (d, changed) = bytes_at(f.data_type(), leaves);
        (Arc::new(f.as_ref().clone().with_data_type(d)), changed)
    };
    match t {
        DataType::Struct(fs) => {
            let (fields, changed): (Vec<FieldRef>, Vec<bool>) = fs.iter().map(field).unzip();
            (DataType::Struct(fields.into()), changed.contains(&true))
        }
        DataType::List(f) => {
            let (f, changed) = field(f);
            (DataType::List(f), changed)
        }
        DataType::LargeList(f) => {
            let (f, changed) = field(f);
            (DataType::LargeList(f), changed)
        }
        DataType::FixedSizeList(f, n) => {
            let (f, changed) = field(f);
            (DataType::FixedSizeList(f, *n), changed)
        }
        DataType::Map(f, sorted) => {
            let (f, changed) = field(f);
            (DataType::Map(f, *sorted), changed)
        }
        leaf => match (leaves.next() == Some(true)).then(|| string_as_bytes(leaf)).flatten() {
            Some(b) => (b, true),
            None => (leaf.clone(), false),
        },
    }
}

fn string_as_bytes(t: &DataType) -> Option<DataType> {
    match t {
        DataType::Utf8 => Some(DataType::Binary),
        DataType::LargeUtf8 => Some(DataType::LargeBinary),
        DataType::Utf8View => Some(DataType::BinaryView),
        DataType::Dictionary(k, v) => string_as_bytes(v).map(|v| DataType::Dictionary(k.clone(), Box::new(v))),
        _ => None,
    }
}

/// `a`, decoded with the types [`as_bytes`] gave, as `target`: the same buffers, each string
/// checked to be UTF-8 (an error naming the first value that is not).
pub fn retype(a: &ArrayRef, target: &DataType) -> Result<ArrayRef, ArrowError> {
    Ok(make_array(retype_data(a.to_data(), target)?))
}

/// Checks `a` as a whole, the UTF-8 of its strings included (for a column decoded as strings
/// that arrow-rs did not check).
pub fn check(a: &ArrayRef) -> Result<(), ArrowError> {
    a.to_data().validate_full()
}

fn retype_data(data: ArrayData, target: &DataType) -> Result<ArrayData, ArrowError> {
    if data.data_type() == target {
        return Ok(data);
    }
    let child_types: Vec<&DataType> = match target {
        DataType::Struct(fs) => fs.iter().map(|f| f.data_type()).collect(),
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) | DataType::Map(f, _) => {
            vec![f.data_type()]
        }
        DataType::Dictionary(_, v) => vec![v.as_ref()],
        _ => Vec::new(),
    };
    if child_types.len() != data.child_data().len() {
        return Err(ArrowError::InvalidArgumentError(format!(
            "decoded as {} where {target} was expected",
            data.data_type()
        )));
    }
    let children = (data.child_data().iter().zip(child_types))
        .map(|(c, t)| retype_data(c.clone(), t))
        .collect::<Result<Vec<_>, _>>()?;
    // `build` validates the array, UTF-8 of every string value included.
    data.into_builder().data_type(target.clone()).child_data(children).build()
}

#[cfg(test)]
mod tests {
    use arrow_array::cast::AsArray;
    use arrow_array::{Array, BinaryArray, BinaryViewArray, LargeBinaryArray, ListArray, StructArray};
    use arrow_schema::Field;

    use super::*;

    #[test]
    fn strings_become_bytes_and_back_with_every_value_checked() {
        let ok: ArrayRef = Arc::new(BinaryArray::from(vec![&b"a"[..], b"\xc3\xa9t\xc3\xa9"]));
        let s = retype(&ok, &DataType::Utf8).unwrap();
        assert_eq!(s.as_string::<i32>().value(1), "été");
        let bad: ArrayRef = Arc::new(LargeBinaryArray::from(vec![&b"a"[..], b"\xff"]));
        let e = retype(&bad, &DataType::LargeUtf8).unwrap_err();
        assert!(e.to_string().contains("UTF8"), "{e}");
        // Views: one short value inline, one long one in a buffer, each checked.
        let long = [b'x'; 20];
        let views: ArrayRef = Arc::new(BinaryViewArray::from(vec![&b"ok"[..], &long[..]]));
        assert_eq!(retype(&views, &DataType::Utf8View).unwrap().as_string_view().value(1), "x".repeat(20));
        let mut bad_long = long;
        bad_long[15] = 0xfe;
        let views: ArrayRef = Arc::new(BinaryViewArray::from(vec![&b"ok"[..], &bad_long[..]]));
        assert!(retype(&views, &DataType::Utf8View).is_err());
        let views: ArrayRef = Arc::new(BinaryViewArray::from(vec![&b"\xfe"[..]]));
        assert!(retype(&views, &DataType::Utf8View).is_err());
    }

    #[test]
    fn nested_strings_are_found_and_checked() {
        let item = Field::new("item", DataType::Utf8, true);
        let list = DataType::List(Arc::new(item.clone()));
        let bytes_list = as_bytes(&list, &[true]).unwrap();
        assert_eq!(bytes_list, DataType::List(Arc::new(item.with_data_type(DataType::Binary))));
        assert_eq!(as_bytes(&list, &[false]), None);
        assert_eq!(as_bytes(&DataType::Int32, &[true]), None);
        // Only the unmarked leaf: a leaf marked UTF8 is read as a string or not at all.
        let st = DataType::Struct(
            vec![
                Field::new("n", DataType::Int32, true),
                Field::new("s", DataType::Utf8View, true),
                Field::new("t", DataType::Utf8View, true),
            ]
            .into(),
        );
        let DataType::Struct(fs) = as_bytes(&st, &[false, true, false]).unwrap() else { panic!("a struct") };
        let types: Vec<&DataType> = fs.iter().map(|f| f.data_type()).collect();
        assert_eq!(types, [&DataType::Int32, &DataType::BinaryView, &DataType::Utf8View]);
        let dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        let bytes_dict = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Binary));
        assert_eq!(as_bytes(&dict, &[true]), Some(bytes_dict));

        let values = BinaryArray::from(vec![&b"a"[..], b"b", b"\xff"]);
        let offsets = arrow_buffer::OffsetBuffer::new(vec![0, 2, 3].into());
        let field = Arc::new(Field::new("item", DataType::Binary, true));
        let a: ArrayRef = Arc::new(ListArray::new(field, offsets, Arc::new(values), None));
        let e = retype(&a, &list).unwrap_err();
        assert!(e.to_string().contains("UTF8"), "{e}");
        let good = BinaryArray::from(vec![&b"a"[..]]);
        let st: ArrayRef = Arc::new(StructArray::from(vec![(
            Arc::new(Field::new("s", DataType::Binary, true)),
            Arc::new(good) as ArrayRef,
        )]));
        let want = DataType::Struct(vec![Field::new("s", DataType::Utf8, true)].into());
        let got = retype(&st, &want).unwrap();
        assert_eq!(got.data_type(), &want);
        assert_eq!(got.as_struct().column(0).as_string::<i32>().value(0), "a");
    }
}
