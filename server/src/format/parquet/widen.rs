//! The types a later file may hold a dataset's column in besides the dataset's own (its first
//! file's), and their conversion to the dataset's type, as `pyarrow.dataset` reads a directory of
//! files written by different tools: pandas 3 writes `large_string` where `pyarrow.table` writes
//! `string`, a script infers `int32` or `float32` for one shard and `int64` or `float64` for the
//! next, a struct's children come in another order (a dict built in another order) or one of them
//! is missing, a Hugging Face image's `bytes` is `large_binary` in one shard, a pandas categorical
//! has int8 indices in one shard and int16 in the next, or plain strings.
//!
//! Only conversions that keep every value: integers into wider integers that hold each value of
//! the narrower one (signed from signed, signed or unsigned from unsigned), `float16` and
//! `float32` into wider floats, integers into floats whose mantissa holds every one of their
//! values exactly (up to 16 bits into `float32`, up to 32 into `float64`: a column inferred as
//! integers in a shard whose values happened to be whole), decimals into decimals of the same
//! scale and a precision at least theirs (the same stored integers), strings or binary between 32- and 64-bit offsets (the values are shared, the offsets
//! rewritten; 64-bit offsets past 2 GiB in one row group cannot fit 32 bits and fail that row
//! group by name), lists between offset widths, and inside structs and lists the same, recursively.
//! Timestamps and durations in another unit are delivered in the finer one (pandas writes
//! nanoseconds, Spark and polars microseconds; a value past what 64-bit nanoseconds hold fails its
//! row group by name); zoned timestamps in the dataset's zone (the same instants), zone-less ones
//! only with zone-less ones.
//! A dictionary column is delivered with the wider files' indices, or decoded when a file holds
//! its values plain (the delivered type is then the values', from every file).
//! A struct's children are matched by name, never by place: a child the file lacks is delivered
//! as nulls, one the dataset lacks is not delivered. A narrowing could lose values mid-epoch, so it
//! is not here: the dataset refuses the file when it is opened ([`super::schema`]). [`join`] is
//! that open-time check (and the delivered type, whose nested children become nullable where a
//! file's are or lacks them); [`convert`] turns each row group into it as it is decoded
//! ([`super::schema::FileProjection::arrange`]).

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Decimal128Type, Decimal256Type, Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type,
    UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{
    Array, ArrayRef, BinaryViewArray, FixedSizeListArray, GenericBinaryArray, GenericListArray, GenericStringArray,
    OffsetSizeTrait, StringViewArray, StructArray, make_array, new_null_array,
};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_data::ArrayData;
use arrow_schema::{ArrowError, DataType, Field, FieldRef, Fields, TimeUnit};

/// Values of a file's narrower type that the dataset's type cannot hold, found as a row group is
/// converted (carried inside an [`ArrowError::ExternalError`] so that [`convert`]'s callers can
/// tell it from damaged data: [`unfit_reason`]).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unfit(String);

fn unfit(reason: String) -> ArrowError {
    ArrowError::ExternalError(Box::new(Unfit(reason)))
}

/// What did not fit, when `e` is a conversion's [`Unfit`].
pub fn unfit_reason(e: &ArrowError) -> Option<String> {
    match e {
        ArrowError::ExternalError(inner) => inner.downcast_ref::<Unfit>().map(|u| u.0.clone()),
        _ => None,
    }
}

/// Where, inside a column, a file's type cannot be delivered as the dataset's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The path below the column (`.bytes`, `[]` for a list's values); empty at the top.
    pub path: String,
    pub found: DataType,
    pub expected: DataType,
}

/// The type to deliver a column as, given the file's type `found` for a column the dataset
/// delivers as `expected`: `expected`, with nested children made nullable where `found`'s are,
/// are typeless or missing. A [`Mismatch`] where no lossless conversion exists.
pub fn join(found: &DataType, expected: &DataType) -> Result<DataType, Mismatch> {
    use DataType as T;
    let mismatch = || Mismatch { path: String::new(), found: found.clone(), expected: expected.clone() };
    let inside = |m: Mismatch, at: &str| Mismatch { path: format!("{at}{}", m.path), ..m };
    match (found, expected) {
        _ if found == expected => Ok(expected.clone()),
        (T::Null, _) => Ok(expected.clone()),
        // Times in another unit (pandas writes nanoseconds, Spark and polars microseconds): the
        // finer unit of the two holds both. Zoned times are UTC instants whatever their zone
        // (which only says how to show them): shown in the dataset's zone, as pyarrow.dataset
        // does. A zone-less timestamp is a wall-clock time, not an instant: only with another.
        (T::Timestamp(g, gz), T::Timestamp(w, wz)) if gz.is_some() == wz.is_some() => {
            Ok(T::Timestamp(finer(*g, *w), wz.clone()))
        }
        (T::Duration(g), T::Duration(w)) => Ok(T::Duration(finer(*g, *w))),
        (T::Struct(got), T::Struct(want)) => {
            // A struct sharing no child with the dataset's is another column, not a narrower one.
            if !want.iter().any(|w| got.find(w.name()).is_some()) {
                return Err(mismatch());
            }
            let fields = want
                .iter()
                .map(|w| {
                    let g = got.find(w.name()).map(|(_, g)| g.as_ref());
                    join_field(g, w).map_err(|m| inside(m, &format!(".{}", w.name())))
                })
                .collect::<Result<Fields, _>>()?;
            Ok(T::Struct(fields))
        }
        (T::List(g) | T::LargeList(g), T::List(w)) => Ok(T::List(join_list(g, w)?)),
        (T::List(g) | T::LargeList(g), T::LargeList(w)) => Ok(T::LargeList(join_list(g, w)?)),
        (T::FixedSizeList(g, n), T::FixedSizeList(w, m)) if n == m => Ok(T::FixedSizeList(join_list(g, w)?, *m)),
        // Dictionaries (pandas' categoricals): indices as wide as the wider file's (pandas writes
        // int8 up to 127 categories, int16 past them), values joined.
        (T::Dictionary(gk, gv), T::Dictionary(wk, wv)) => {
            let values = join(gv, wv)?;
            let keys = if gk == wk || widening(gk, wk).is_some() {
                wk
            } else if widening(wk, gk).is_some() {
                gk
            } else {
                return Err(mismatch());
            };
            Ok(T::Dictionary(keys.clone(), Box::new(values)))
        }
        // A dictionary here, its values in the dataset: decoded.
        (T::Dictionary(_, gv), _) => join(gv, expected),
        // Plain values here, a dictionary in the dataset: the column is delivered decoded, from
        // every file (its values are the same in either form).
        (_, T::Dictionary(_, wv)) => join(found, wv),
        // Maps as they were: the same type, up to their children's names.
        (T::Map(..), _) if found.equals_datatype(expected) => Ok(expected.clone()),
        // The same scale: a precision at least the file's holds each stored integer as it is.
        (T::Decimal128(gp, gs), T::Decimal128(wp, ws)) | (T::Decimal256(gp, gs), T::Decimal256(wp, ws))
            if gs == ws && gp <= wp =>
        {
            Ok(expected.clone())
        }
        _ if widening(found, expected).is_some() => Ok(expected.clone()),
        _ => Err(mismatch()),
    }
}

fn join_list(got: &Field, want: &FieldRef) -> Result<FieldRef, Mismatch> {
    join_field(Some(got), want).map(Arc::new).map_err(|m| Mismatch { path: format!("[]{}", m.path), ..m })
}

/// `want` as delivered given the file's `got` (None: the file lacks it, delivered as nulls).
fn join_field(got: Option<&Field>, want: &Field) -> Result<Field, Mismatch> {
    let Some(got) = got else { return Ok(want.clone().with_nullable(true)) };
    let t = join(got.data_type(), want.data_type())?;
    let nullable = want.is_nullable() || got.is_nullable() || got.data_type() == &DataType::Null;
    Ok(want.clone().with_data_type(t).with_nullable(nullable))
}

/// `a` as type `to`, which [`join`] gave for `a`'s type (or which holds `a`'s bytes retyped as
/// strings, [`super::strings::retype`]): structs by their children's names, lists by their
/// values, leaves by [`widening`].
pub fn convert(a: &ArrayRef, to: &DataType) -> Result<ArrayRef, ArrowError> {
    use DataType as T;
    match (a.data_type(), to) {
        (from, to) if from == to => Ok(a.clone()),
        (T::Null, to) => Ok(new_null_array(to, a.len())),
        (T::Struct(_), T::Struct(fields)) => {
            let s = a.as_struct();
            let columns = fields
                .iter()
                .map(|f| match s.column_by_name(f.name()) {
                    Some(c) => convert(c, f.data_type()),
                    None => Ok(new_null_array(f.data_type(), s.len())),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Arc::new(StructArray::try_new(fields.clone(), columns, s.nulls().cloned())?))
        }
        (T::List(_), T::List(f)) => list::<i32, i32>(a, f),
        (T::List(_), T::LargeList(f)) => list::<i32, i64>(a, f),
        (T::LargeList(_), T::List(f)) => list::<i64, i32>(a, f),
        (T::LargeList(_), T::LargeList(f)) => list::<i64, i64>(a, f),
        (T::FixedSizeList(_, _), T::FixedSizeList(f, n)) => {
            let l = a.as_fixed_size_list();
            let values = convert(l.values(), f.data_type())?;
            Ok(Arc::new(FixedSizeListArray::try_new(f.clone(), *n, values, l.nulls().cloned())?))
        }
        (T::Timestamp(from, _), T::Timestamp(to_unit, _)) | (T::Duration(from), T::Duration(to_unit)) => {
            finer_ticks(a, *from, *to_unit, to)
        }
        (T::Dictionary(_, _), T::Dictionary(keys, values)) => {
            let d = a.as_any_dictionary();
            let k = convert(&make_array(d.keys().to_data()), keys)?;
            let v = convert(d.values(), values)?;
            let data = k.to_data().into_builder().data_type(to.clone()).child_data(vec![v.to_data()]);
            Ok(make_array(data.build()?))
        }
        (T::Dictionary(_, _), to) => {
            let d = a.as_any_dictionary();
            convert(&arrow_select::take::take(d.values().as_ref(), d.keys(), None)?, to)
        }
        (T::Decimal128(..), T::Decimal128(p, s)) => {
            Ok(Arc::new(a.as_primitive::<Decimal128Type>().clone().with_precision_and_scale(*p, *s)?))
        }
        (T::Decimal256(..), T::Decimal256(p, s)) => {
            Ok(Arc::new(a.as_primitive::<Decimal256Type>().clone().with_precision_and_scale(*p, *s)?))
        }
        // The view types a flat projection's row groups are delivered in ([`super::schema`]),
        // for a column decoded otherwise (a dictionary in this file, decoded above).
        (T::Utf8, T::Utf8View) => Ok(Arc::new(StringViewArray::from(a.as_string::<i32>()))),
        (T::LargeUtf8, T::Utf8View) => Ok(Arc::new(StringViewArray::from(a.as_string::<i64>()))),
        (T::Binary, T::BinaryView) => Ok(Arc::new(BinaryViewArray::from(a.as_binary::<i32>()))),
        (T::LargeBinary, T::BinaryView) => Ok(Arc::new(BinaryViewArray::from(a.as_binary::<i64>()))),
        (from, to) => match widening(from, to) {
            Some(widen) => widen(a),
            None => super::strings::retype(a, to),
        },
    }
}

/// The finer of two time units.
fn finer(a: TimeUnit, b: TimeUnit) -> TimeUnit {
    let rank = |u: TimeUnit| match u {
        TimeUnit::Second => 0,
        TimeUnit::Millisecond => 1,
        TimeUnit::Microsecond => 2,
        TimeUnit::Nanosecond => 3,
    };
    if rank(a) >= rank(b) { a } else { b }
}

/// `a`'s times (i64 ticks of `from`) in the finer unit `unit`, as type `to`: an error naming the
/// first value whose ticks overflow (before 1677 or after 2262 in nanoseconds).
fn finer_ticks(a: &ArrayRef, from: TimeUnit, unit: TimeUnit, to: &DataType) -> Result<ArrayRef, ArrowError> {
    let per_second = |u: TimeUnit| match u {
        TimeUnit::Second => 1i64,
        TimeUnit::Millisecond => 1_000,
        TimeUnit::Microsecond => 1_000_000,
        TimeUnit::Nanosecond => 1_000_000_000,
    };
    let (f, t) = (per_second(from), per_second(unit));
    if t < f || t % f != 0 {
        return Err(unfit(format!("{from:?} cannot be made {unit:?} without loss")));
    }
    let factor = t / f;
    let data = a.to_data();
    let ticks = data.buffer::<i64>(0).get(..a.len()).unwrap_or_default();
    let scaled = ticks
        .iter()
        .enumerate()
        .map(|(i, &v)| match v.checked_mul(factor) {
            Some(s) => Ok(s),
            // A null slot's value is whatever the writer left there.
            None if a.is_null(i) => Ok(0),
            None => Err(unfit(format!("{v} {from:?} ticks do not fit the dataset's {unit:?} (64-bit ticks)"))),
        })
        .collect::<Result<Vec<i64>, _>>()?;
    let data =
        ArrayData::builder(to.clone()).len(a.len()).add_buffer(scaled.into()).nulls(a.logical_nulls()).build()?;
    Ok(make_array(data))
}

fn list<F: OffsetSizeTrait, O: OffsetSizeTrait>(a: &ArrayRef, field: &FieldRef) -> Result<ArrayRef, ArrowError> {
    let l = a.as_list::<F>();
    let offsets = offsets::<F, O>(l.offsets())?;
    let values = convert(l.values(), field.data_type())?;
    Ok(Arc::new(GenericListArray::<O>::try_new(field.clone(), offsets, values, l.nulls().cloned())?))
}

/// Turns a column of one type into the same values of another.
type Widen = fn(&ArrayRef) -> Result<ArrayRef, ArrowError>;

/// How to make a leaf column of type `from` one of type `to` without losing a value; None when
/// that cannot be done, or for the same type.
fn widening(from: &DataType, to: &DataType) -> Option<Widen> {
    use DataType as T;
    // Each pair is lossless by `From` between the native types: the compiler checks the table.
    macro_rules! numbers {
        ($from:ty => $to:ty) => {
            (|a: &ArrayRef| Ok(Arc::new(a.as_primitive::<$from>().unary::<_, $to>(|v| v.into())) as ArrayRef)) as Widen
        };
    }
    Some(match (from, to) {
        (T::Int8, T::Int16) => numbers!(Int8Type => Int16Type),
        (T::Int8, T::Int32) => numbers!(Int8Type => Int32Type),
        (T::Int8, T::Int64) => numbers!(Int8Type => Int64Type),
        (T::Int16, T::Int32) => numbers!(Int16Type => Int32Type),
        (T::Int16, T::Int64) => numbers!(Int16Type => Int64Type),
        (T::Int32, T::Int64) => numbers!(Int32Type => Int64Type),
        (T::UInt8, T::UInt16) => numbers!(UInt8Type => UInt16Type),
        (T::UInt8, T::UInt32) => numbers!(UInt8Type => UInt32Type),
        (T::UInt8, T::UInt64) => numbers!(UInt8Type => UInt64Type),
        (T::UInt8, T::Int16) => numbers!(UInt8Type => Int16Type),
        (T::UInt8, T::Int32) => numbers!(UInt8Type => Int32Type),
        (T::UInt8, T::Int64) => numbers!(UInt8Type => Int64Type),
        (T::UInt16, T::UInt32) => numbers!(UInt16Type => UInt32Type),
        (T::UInt16, T::UInt64) => numbers!(UInt16Type => UInt64Type),
        (T::UInt16, T::Int32) => numbers!(UInt16Type => Int32Type),
        (T::UInt16, T::Int64) => numbers!(UInt16Type => Int64Type),
        (T::UInt32, T::UInt64) => numbers!(UInt32Type => UInt64Type),
        (T::UInt32, T::Int64) => numbers!(UInt32Type => Int64Type),
        (T::Float32, T::Float64) => numbers!(Float32Type => Float64Type),
        (T::Float16, T::Float32) => numbers!(Float16Type => Float32Type),
        (T::Float16, T::Float64) => numbers!(Float16Type => Float64Type),
        (T::Int8, T::Float32) => numbers!(Int8Type => Float32Type),
        (T::Int16, T::Float32) => numbers!(Int16Type => Float32Type),
        (T::UInt8, T::Float32) => numbers!(UInt8Type => Float32Type),
        (T::UInt16, T::Float32) => numbers!(UInt16Type => Float32Type),
        (T::Int8, T::Float64) => numbers!(Int8Type => Float64Type),
        (T::Int16, T::Float64) => numbers!(Int16Type => Float64Type),
        (T::Int32, T::Float64) => numbers!(Int32Type => Float64Type),
        (T::UInt8, T::Float64) => numbers!(UInt8Type => Float64Type),
        (T::UInt16, T::Float64) => numbers!(UInt16Type => Float64Type),
        (T::UInt32, T::Float64) => numbers!(UInt32Type => Float64Type),
        (T::Utf8, T::LargeUtf8) => strings::<i32, i64>,
        (T::LargeUtf8, T::Utf8) => strings::<i64, i32>,
        (T::Binary, T::LargeBinary) => binary::<i32, i64>,
        (T::LargeBinary, T::Binary) => binary::<i64, i32>,
        _ => return None,
    })
}

fn strings<F: OffsetSizeTrait, O: OffsetSizeTrait>(a: &ArrayRef) -> Result<ArrayRef, ArrowError> {
    let a = a.as_string::<F>();
    let offsets = offsets::<F, O>(a.offsets())?;
    Ok(Arc::new(GenericStringArray::<O>::try_new(offsets, a.values().clone(), a.nulls().cloned())?))
}

fn binary<F: OffsetSizeTrait, O: OffsetSizeTrait>(a: &ArrayRef) -> Result<ArrayRef, ArrowError> {
    let a = a.as_binary::<F>();
    let offsets = offsets::<F, O>(a.offsets())?;
    Ok(Arc::new(GenericBinaryArray::<O>::try_new(offsets, a.values().clone(), a.nulls().cloned())?))
}

/// The same offsets in the other width; an error when one does not fit (more than 2 GiB of
/// values before it, going to 32 bits).
fn offsets<F: OffsetSizeTrait, O: OffsetSizeTrait>(from: &OffsetBuffer<F>) -> Result<OffsetBuffer<O>, ArrowError> {
    let converted = from
        .iter()
        .map(|o| {
            O::from_usize(o.as_usize()).ok_or_else(|| {
                unfit(format!("offset {} in one row group does not fit the dataset's 32-bit offsets", o.as_usize()))
            })
        })
        .collect::<Result<Vec<O>, _>>()?;
    // Valid: the offsets of a valid array, each the same value in the other width.
    Ok(OffsetBuffer::new(ScalarBuffer::from(converted)))
}

#[cfg(test)]
mod tests {
    use arrow_array::{
        Decimal128Array, Float16Array, Int8Array, Int32Array, LargeBinaryArray, StringArray, UInt8Array,
    };

    use super::*;

    #[test]
    fn widens_without_loss_and_refuses_what_could_lose() {
        let ints: ArrayRef = Arc::new(Int32Array::from(vec![Some(i32::MIN), None, Some(i32::MAX)]));
        let wide = widening(&DataType::Int32, &DataType::Int64).unwrap()(&ints).unwrap();
        assert_eq!(
            wide.as_primitive::<Int64Type>().iter().collect::<Vec<_>>(),
            [Some(i64::from(i32::MIN)), None, Some(i64::from(i32::MAX))]
        );
        let bytes: ArrayRef = Arc::new(UInt8Array::from(vec![0, 255]));
        let wide = widening(&DataType::UInt8, &DataType::Int16).unwrap()(&bytes).unwrap();
        assert_eq!(wide.as_primitive::<Int16Type>().values().to_vec(), [0, 255]);
        let s: ArrayRef = Arc::new(StringArray::from(vec![Some("ab"), None, Some("")]).slice(1, 2));
        let large = widening(&DataType::Utf8, &DataType::LargeUtf8).unwrap()(&s).unwrap();
        assert_eq!(large.as_string::<i64>().iter().collect::<Vec<_>>(), [None, Some("")]);
        let b: ArrayRef = Arc::new(LargeBinaryArray::from(vec![Some(&b"xyz"[..]), None]));
        let small = widening(&DataType::LargeBinary, &DataType::Binary).unwrap()(&b).unwrap();
        assert_eq!(small.as_binary::<i32>().iter().collect::<Vec<_>>(), [Some(&b"xyz"[..]), None]);
        let ints: ArrayRef = Arc::new(Int32Array::from(vec![Some(i32::MIN), None, Some(i32::MAX)]));
        let floats = widening(&DataType::Int32, &DataType::Float64).unwrap()(&ints).unwrap();
        assert_eq!(
            floats.as_primitive::<Float64Type>().iter().collect::<Vec<_>>(),
            [Some(f64::from(i32::MIN)), None, Some(f64::from(i32::MAX))]
        );
        type F16 = <Float16Type as arrow_array::ArrowPrimitiveType>::Native;
        let halves: ArrayRef = Arc::new(Float16Array::from(vec![F16::from_f32(0.5), F16::MAX]));
        let floats = widening(&DataType::Float16, &DataType::Float32).unwrap()(&halves).unwrap();
        assert_eq!(floats.as_primitive::<Float32Type>().values().to_vec(), [0.5, 65504.0]);
        for (from, to) in [
            (DataType::Int64, DataType::Int32),
            (DataType::Int8, DataType::UInt64),
            (DataType::UInt64, DataType::Int64),
            (DataType::Float64, DataType::Float32),
            (DataType::Int64, DataType::Float64),
            // 2^24 + 1 has no float32: only up to 16-bit integers go into one.
            (DataType::Int32, DataType::Float32),
            (DataType::UInt64, DataType::Float64),
            (DataType::Float32, DataType::Float16),
            (DataType::Int64, DataType::Utf8),
            (DataType::Int32, DataType::Int32),
        ] {
            assert!(widening(&from, &to).is_none(), "{from} -> {to}");
        }
    }

    #[test]
    fn decimals_of_the_same_scale_widen_to_a_larger_precision_only() {
        let (narrow, wide) = (DataType::Decimal128(8, 2), DataType::Decimal128(12, 2));
        assert_eq!(join(&narrow, &wide), Ok(wide.clone()));
        for (found, expected) in [
            (wide.clone(), narrow.clone()),
            (DataType::Decimal128(8, 2), DataType::Decimal128(12, 3)),
            (DataType::Decimal128(8, 2), DataType::Decimal256(12, 2)),
        ] {
            assert!(join(&found, &expected).is_err(), "{found} -> {expected}");
        }
        let values: ArrayRef =
            Arc::new(Decimal128Array::from(vec![Some(-99_999_999), None]).with_precision_and_scale(8, 2).unwrap());
        let got = convert(&values, &wide).unwrap();
        assert_eq!(got.data_type(), &wide);
        assert_eq!(got.as_primitive::<Decimal128Type>().iter().collect::<Vec<_>>(), [Some(-99_999_999), None]);
    }

    fn field(name: &str, t: DataType, nullable: bool) -> FieldRef {
        Arc::new(Field::new(name, t, nullable))
    }

    #[test]
    fn struct_children_go_by_name_widened_inside_and_filled_when_missing() {
        use arrow_array::{Int64Array, LargeStringArray, ListArray, StringArray};
        // The file's struct: {y: int32 (nullable), x: int64, z: utf8}, the dataset's {x, y: int64
        // (not nullable), w: large_utf8}, inside a list of each list type.
        let file = Fields::from(vec![
            field("y", DataType::Int32, true),
            field("x", DataType::Int64, false),
            field("z", DataType::Utf8, false),
        ]);
        let want = Fields::from(vec![
            field("x", DataType::Int64, false),
            field("y", DataType::Int64, false),
            field("w", DataType::LargeUtf8, false),
        ]);
        let from = DataType::LargeList(field("element", DataType::Struct(file.clone()), true));
        let to = DataType::List(field("item", DataType::Struct(want), true));
        let joined = join(&from, &to).unwrap();
        let DataType::List(item) = &joined else { panic!("{joined}") };
        let DataType::Struct(children) = item.data_type() else { panic!("{item}") };
        let nullable: Vec<_> = children.iter().map(|f| (f.name().as_str(), f.is_nullable())).collect();
        assert_eq!(nullable, [("x", false), ("y", true), ("w", true)]);

        let s = StructArray::try_new(
            file,
            vec![
                Arc::new(Int32Array::from(vec![Some(10), None, Some(30)])),
                Arc::new(Int64Array::from(vec![1, 2, 3])),
                Arc::new(StringArray::from(vec!["a", "b", "c"])),
            ],
            None,
        )
        .unwrap();
        let DataType::LargeList(element) = &from else { unreachable!() };
        let list = arrow_array::LargeListArray::try_new(
            element.clone(),
            OffsetBuffer::new(ScalarBuffer::from(vec![0i64, 1, 3])),
            Arc::new(s),
            None,
        )
        .unwrap();
        let list: ArrayRef = Arc::new(list.slice(1, 1));
        let got = convert(&list, &joined).unwrap();
        assert_eq!(got.data_type(), &joined);
        let got: &ListArray = got.as_list::<i32>();
        let row = got.value(0);
        let row = row.as_struct();
        assert_eq!(row.column(0).as_primitive::<Int64Type>().values().to_vec(), [2, 3]);
        assert_eq!(row.column(1).as_primitive::<Int64Type>().iter().collect::<Vec<_>>(), [None, Some(30)]);
        assert_eq!(row.column(2).as_any().downcast_ref::<LargeStringArray>().unwrap().null_count(), 2);
    }

    #[test]
    fn a_nested_narrowing_is_named_by_its_path() {
        let from = DataType::Struct(Fields::from(vec![field(
            "pts",
            DataType::List(field("item", DataType::Int64, true)),
            true,
        )]));
        let to = DataType::Struct(Fields::from(vec![field(
            "pts",
            DataType::List(field("element", DataType::Int32, true)),
            true,
        )]));
        let m = join(&from, &to).unwrap_err();
        assert_eq!((m.path.as_str(), m.found, m.expected), (".pts[]", DataType::Int64, DataType::Int32));
        // A struct sharing no child with the dataset's is another column.
        let other = DataType::Struct(Fields::from(vec![field("q", DataType::Int64, true)]));
        assert_eq!(join(&other, &to).unwrap_err().path, "");
        // A list's values name is the writer's (pyarrow "item", Spark and Parquet "element").
        let a = DataType::List(field("item", DataType::Int64, true));
        let b = DataType::List(field("element", DataType::Int64, true));
        assert_eq!(join(&a, &b).unwrap(), b);
    }

    #[test]
    fn dictionaries_take_the_wider_indices_or_are_decoded_beside_plain_values() {
        use arrow_array::{DictionaryArray, StringArray};
        let dict8 = DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::LargeUtf8));
        let dict16 = DataType::Dictionary(Box::new(DataType::Int16), Box::new(DataType::LargeUtf8));
        assert_eq!(join(&dict16, &dict8).unwrap(), dict16);
        assert_eq!(join(&dict8, &dict16).unwrap(), dict16);
        assert_eq!(join(&DataType::LargeUtf8, &dict8).unwrap(), DataType::LargeUtf8);
        assert_eq!(join(&dict16, &DataType::LargeUtf8).unwrap(), DataType::LargeUtf8);
        let numbers = DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Int64));
        assert!(join(&numbers, &dict8).is_err());

        let keys = Int8Array::from(vec![Some(1), None, Some(0), Some(1)]);
        let a: ArrayRef =
            Arc::new(DictionaryArray::try_new(keys, Arc::new(StringArray::from(vec!["x", "y"]))).unwrap());
        let a = a.slice(1, 3);
        let wide = convert(&a, &dict16).unwrap();
        assert_eq!(wide.data_type(), &dict16);
        let plain = convert(&wide, &DataType::LargeUtf8).unwrap();
        assert_eq!(plain.as_string::<i64>().iter().collect::<Vec<_>>(), [None, Some("x"), Some("y")]);
        let views = convert(&a, &DataType::Utf8View).unwrap();
        assert_eq!(views.as_string_view().iter().collect::<Vec<_>>(), [None, Some("x"), Some("y")]);
    }

    #[test]
    fn times_go_to_the_finer_unit_and_an_overflow_is_named() {
        use arrow_array::TimestampSecondArray;
        let utc = Some(Arc::from("UTC"));
        let ns = DataType::Timestamp(TimeUnit::Nanosecond, utc.clone());
        let s = DataType::Timestamp(TimeUnit::Second, utc.clone());
        assert_eq!(join(&ns, &s).unwrap(), ns);
        assert_eq!(join(&s, &ns).unwrap(), ns);
        assert!(join(&DataType::Timestamp(TimeUnit::Second, None), &s).is_err());
        assert!(join(&s, &DataType::Timestamp(TimeUnit::Second, None)).is_err());
        let paris = DataType::Timestamp(TimeUnit::Millisecond, Some(Arc::from("Europe/Paris")));
        assert_eq!(join(&paris, &s).unwrap(), DataType::Timestamp(TimeUnit::Millisecond, utc.clone()));
        // The same ticks, shown in the dataset's zone.
        let p: ArrayRef = Arc::new(arrow_array::TimestampMillisecondArray::from(vec![5]).with_timezone("Europe/Paris"));
        let got = convert(&p, &ns).unwrap();
        assert_eq!(got.data_type(), &ns);
        assert_eq!(got.as_primitive::<arrow_array::types::TimestampNanosecondType>().value(0), 5_000_000);
        assert_eq!(
            join(&DataType::Duration(TimeUnit::Millisecond), &DataType::Duration(TimeUnit::Second)).unwrap(),
            DataType::Duration(TimeUnit::Millisecond)
        );
        // A null slot's value may be anything: it does not fail the conversion.
        let a = TimestampSecondArray::from(vec![Some(7), Some(1), None, Some(2)]).with_timezone("UTC");
        let a: ArrayRef = Arc::new(a.slice(1, 3));
        let got = convert(&a, &ns).unwrap();
        assert_eq!(got.data_type(), &ns);
        let got = got.as_primitive::<arrow_array::types::TimestampNanosecondType>();
        assert_eq!(got.iter().collect::<Vec<_>>(), [Some(1_000_000_000), None, Some(2_000_000_000)]);
        let far: ArrayRef = Arc::new(TimestampSecondArray::from(vec![i64::MAX / 10]).with_timezone("UTC"));
        let e = convert(&far, &ns).unwrap_err().to_string();
        assert!(e.contains("do not fit"), "{e}");
    }
}
