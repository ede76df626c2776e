//! Time zones of timestamps that a file stores at another unit than its Arrow schema says.
//!
//! pyarrow stores a `timestamp[s, tz]` column in milliseconds (Parquet has no seconds, and format
//! versions before 2.6 no nanoseconds) and keeps the column's Arrow type, zone included, in the
//! file's embedded Arrow schema (`ARROW:schema`). arrow-rs takes that hint for a timestamp only
//! when its unit is the stored one, so such a column came back in UTC where pyarrow gives its zone
//! (the instants were right, the zone was not). [`rezone`] gives those columns the hint's zone at
//! the stored unit, as pyarrow does.

use std::sync::Arc;

use arrow_schema::{DataType, Field, FieldRef, Fields, Schema};
use base64::Engine;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::errors::ParquetError;

/// `meta` with the embedded Arrow schema's zones on zoned timestamps arrow-rs read as UTC; `meta`
/// itself when there are none (or no embedded schema it can read: arrow-rs ignored it too).
pub fn rezone(meta: ArrowReaderMetadata) -> Result<ArrowReaderMetadata, ParquetError> {
    // Every footer read comes here: the embedded schema is decoded again only for a file that
    // has a timestamp arrow-rs read as UTC.
    if !meta.schema().fields().iter().any(|f| has_utc_timestamp(f.data_type())) {
        return Ok(meta);
    }
    let Some(hint) = embedded_schema(&meta) else { return Ok(meta) };
    let schema = meta.schema();
    let mut changed = false;
    let fields: Vec<FieldRef> = schema
        .fields()
        .iter()
        .map(|f| match hint.field_with_name(f.name()).ok().and_then(|h| zoned(f.data_type(), h.data_type())) {
            Some(t) => {
                changed = true;
                Arc::new(f.as_ref().clone().with_data_type(t))
            }
            None => f.clone(),
        })
        .collect();
    if !changed {
        return Ok(meta);
    }
    let fixed = Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()));
    ArrowReaderMetadata::try_new(meta.metadata().clone(), ArrowReaderOptions::new().with_schema(fixed))
}

/// How arrow-rs names the zone of a timestamp Parquet marks as adjusted to UTC.
fn is_utc(tz: &str) -> bool {
    matches!(tz, "UTC" | "+00:00")
}

fn has_utc_timestamp(t: &DataType) -> bool {
    match t {
        DataType::Timestamp(_, Some(tz)) => is_utc(tz),
        DataType::Struct(fs) => fs.iter().any(|f| has_utc_timestamp(f.data_type())),
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => has_utc_timestamp(f.data_type()),
        _ => false,
    }
}

/// The file's `ARROW:schema`, decoded as arrow-rs decodes it.
fn embedded_schema(meta: &ArrowReaderMetadata) -> Option<Schema> {
    let kv = meta.metadata().file_metadata().key_value_metadata()?;
    let encoded = kv.iter().find(|e| e.key == parquet::arrow::ARROW_SCHEMA_META_KEY)?.value.as_deref()?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(encoded).ok()?;
    // An IPC message, after a continuation marker and a length when a writer put them.
    let message = if bytes.len() > 8 && bytes[..4] == [0xff; 4] { &bytes[8..] } else { &bytes[..] };
    let schema = arrow_ipc::root_as_message(message).ok()?.header_as_schema()?;
    arrow_ipc::convert::try_fb_to_schema(schema).ok()
}

/// `read` (what arrow-rs made of a column) with `hint`'s zones where arrow-rs read a zoned
/// timestamp at another unit as UTC, inside structs and lists too; None when nothing changes.
fn zoned(read: &DataType, hint: &DataType) -> Option<DataType> {
    let child = |f: &FieldRef, h: &FieldRef| zoned(f.data_type(), h.data_type()).map(|t| with_type(f, t));
    match (read, hint) {
        (DataType::Timestamp(unit, Some(read_tz)), DataType::Timestamp(hint_unit, Some(hint_tz)))
            if unit != hint_unit && read_tz != hint_tz && is_utc(read_tz) =>
        {
            Some(DataType::Timestamp(*unit, Some(hint_tz.clone())))
        }
        (DataType::Struct(fs), DataType::Struct(hs)) => {
            let mut changed = false;
            let fields: Fields = fs
                .iter()
                .map(|f| match hs.iter().find(|h| h.name() == f.name()).and_then(|h| child(f, h)) {
                    Some(f) => {
                        changed = true;
                        f
                    }
                    None => f.clone(),
                })
                .collect();
            changed.then_some(DataType::Struct(fields))
        }
        (DataType::List(f), DataType::List(h) | DataType::LargeList(h)) => child(f, h).map(DataType::List),
        (DataType::LargeList(f), DataType::List(h) | DataType::LargeList(h)) => child(f, h).map(DataType::LargeList),
        (DataType::FixedSizeList(f, n), DataType::FixedSizeList(h, _)) => {
            child(f, h).map(|f| DataType::FixedSizeList(f, *n))
        }
        _ => None,
    }
}

fn with_type(f: &FieldRef, t: DataType) -> FieldRef {
    Arc::new(Field::clone(f).with_data_type(t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_schema::TimeUnit;

    #[test]
    fn a_zone_at_another_unit_is_taken_where_arrow_rs_read_utc() {
        let paris = Some(Arc::<str>::from("Europe/Paris"));
        let utc = Some(Arc::<str>::from("UTC"));
        let ms_utc = DataType::Timestamp(TimeUnit::Millisecond, utc.clone());
        let s_paris = DataType::Timestamp(TimeUnit::Second, paris.clone());
        let ms_paris = DataType::Timestamp(TimeUnit::Millisecond, paris.clone());
        assert_eq!(zoned(&ms_utc, &s_paris), Some(ms_paris.clone()));
        // Same unit: arrow-rs took the hint itself. A zone-less hint, or UTC asked: nothing.
        assert_eq!(zoned(&ms_paris, &ms_paris), None);
        assert_eq!(zoned(&ms_utc, &DataType::Timestamp(TimeUnit::Second, None)), None);
        assert_eq!(zoned(&ms_utc, &DataType::Timestamp(TimeUnit::Second, utc)), None);
        let list = |t: DataType| DataType::List(Arc::new(Field::new("item", t, true)));
        let strukt = |t: DataType| {
            DataType::Struct(vec![Field::new("a", DataType::Int8, true), Field::new("t", t, true)].into())
        };
        assert_eq!(zoned(&list(ms_utc.clone()), &list(s_paris.clone())), Some(list(ms_paris.clone())));
        assert_eq!(zoned(&strukt(ms_utc), &strukt(s_paris)), Some(strukt(ms_paris)));
    }
}
