//! The narrower types a later file may hold a dataset's column in, and their widening to the
//! dataset's type (its first file's), as `pyarrow.dataset` reads a directory of files written by
//! different tools: pandas 3 writes `large_string` where `pyarrow.table` writes `string`, a script
//! infers `int32` or `float32` for one shard and `int64` or `float64` for the next.
//!
//! Only conversions that keep every value: integers into wider integers that hold each value of
//! the narrower one (signed from signed, signed or unsigned from unsigned), `float32` into
//! `float64`, and strings or binary between 32- and 64-bit offsets (the values are shared, the
//! offsets rewritten; 64-bit offsets past 2 GiB in one row group cannot fit 32 bits and fail that
//! row group by name). A narrowing could lose values mid-epoch, so it is not here: the dataset
//! refuses the file when it is opened ([`super::schema`]). Row groups are widened as they are
//! decoded ([`super::schema::FileProjection::arrange`]).

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrayRef, GenericBinaryArray, GenericStringArray, OffsetSizeTrait};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::{ArrowError, DataType};

/// Turns a column of one type into the same values of another.
pub type Widen = fn(&ArrayRef) -> Result<ArrayRef, ArrowError>;

/// How to make a column of type `from` one of type `to` without losing a value; None when that
/// cannot be done, or for the same type.
pub fn widening(from: &DataType, to: &DataType) -> Option<Widen> {
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
                ArrowError::InvalidArgumentError(format!(
                    "{} bytes of values in one row group do not fit the dataset's 32-bit offsets",
                    o.as_usize()
                ))
            })
        })
        .collect::<Result<Vec<O>, _>>()?;
    // Valid: the offsets of a valid array, each the same value in the other width.
    Ok(OffsetBuffer::new(ScalarBuffer::from(converted)))
}

#[cfg(test)]
mod tests {
    use arrow_array::{Int32Array, LargeBinaryArray, StringArray, UInt8Array};

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
        for (from, to) in [
            (DataType::Int64, DataType::Int32),
            (DataType::Int8, DataType::UInt64),
            (DataType::UInt64, DataType::Int64),
            (DataType::Float64, DataType::Float32),
            (DataType::Int64, DataType::Float64),
            (DataType::Int64, DataType::Utf8),
            (DataType::Int32, DataType::Int32),
        ] {
            assert!(widening(&from, &to).is_none(), "{from} -> {to}");
        }
    }
}
