//! Places that are tables with a log of their own, whose files are not their rows. A Delta Lake
//! table keeps in its directory the Parquet files that an overwrite, DELETE or UPDATE removed,
//! until VACUUM deletes them, and only its `_delta_log/` says which files are current. An Iceberg
//! table keeps the same under `data/` until its snapshots expire, and only `metadata/` beside it
//! says which are current. Listed as a directory of shards, either would serve removed rows beside
//! the current ones (as `pyarrow.dataset` on the same directory does), so a listing of one is
//! refused; a glob or named files serve them knowingly.

use crate::Error;

/// The subdirectory that makes a place a Delta Lake table.
pub const DELTA_LOG: &str = "_delta_log";

/// The refusal of a listing of the Delta Lake table at `place` (ending with `/`).
pub fn delta_table(place: &str) -> Error {
    Error::invalid(format!(
        "{place} is a Delta Lake table (it has {DELTA_LOG}/): its directory keeps the files an overwrite, \
         DELETE or UPDATE removed until VACUUM, so its Parquet files are not its rows and serving them would \
         serve removed rows too. Write the table's current version out as Parquet files (deltalake: \
         DeltaTable(path).to_pyarrow_dataset(), then pyarrow.dataset.write_dataset) and read those, or, to \
         serve every file there knowingly, name them with a glob ({place}*.parquet)"
    ))
}

/// An Iceberg table's subdirectory of snapshots and manifests.
pub const ICEBERG_METADATA: &str = "metadata";

/// An Iceberg table's subdirectory of data files (the default `write.data.path`).
pub const ICEBERG_DATA: &str = "data";

/// Whether a file in a `metadata/` directory is an Iceberg table's: a table version
/// (`00001-<uuid>.metadata.json`, `v1.metadata.json`, either maybe `.gz.`), a Hadoop catalog's
/// `version-hint.text`, a snapshot's manifest list (`snap-*.avro`) or a manifest
/// (`<uuid>-m0.avro`). Any one will do: the first page of an S3 listing holds at least one,
/// whichever sorts first.
pub fn is_iceberg_metadata(name: &str) -> bool {
    let manifest = || {
        name.strip_suffix(".avro")
            .and_then(|stem| stem.rsplit_once("-m"))
            .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    name.ends_with(".metadata.json")
        || name == "version-hint.text"
        || (name.starts_with("snap-") && name.ends_with(".avro"))
        || manifest()
}

/// The place above an Iceberg table's `data/` directory: `place` (ending with `/`) without its
/// last component when that is `data/`, else `None`.
pub fn iceberg_table_above(place: &str) -> Option<&str> {
    place.strip_suffix(&format!("{ICEBERG_DATA}/")).filter(|table| table.is_empty() || table.ends_with('/'))
}

/// The refusal of a listing of the Iceberg table at `table` (ending with `/`), named as `named`:
/// the table's own directory or its `data/`.
pub fn iceberg_table(table: &str, named: &str) -> Error {
    let what = match named == table {
        true => format!("{table} is an Iceberg table"),
        false => format!("{named} is the data directory of the Iceberg table {table}"),
    };
    Error::invalid(format!(
        "{what} ({table}{ICEBERG_METADATA}/ holds its snapshots): its \
         {ICEBERG_DATA}/ keeps the files an overwrite, delete or compaction dropped from the current snapshot \
         until the snapshots expire, so its Parquet files are not its rows and serving them would serve dropped \
         rows too. Write the current snapshot out as Parquet files (pyiceberg: catalog.load_table(name).scan()\
         .to_arrow(), then pyarrow.parquet.write_table or pyarrow.dataset.write_dataset) and read those, or, to \
         serve every file there knowingly, name them with a glob ({table}{ICEBERG_DATA}/*.parquet)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iceberg_metadata_files_are_known_by_their_names() {
        for name in [
            "00000-0858d916-e053-4ded-8bd4-4a95089703f2.metadata.json",
            "00003-0858d916.gz.metadata.json",
            "v1.metadata.json",
            "version-hint.text",
            "snap-2024843196931574250-0-e43666f4-37cd-420c-9d44-c1e6400fb445.avro",
            "7c685ba1-90d6-4336-b23b-bef6df4c804b-m0.avro",
            "7c685ba1-90d6-4336-b23b-bef6df4c804b-m12.avro",
        ] {
            assert!(is_iceberg_metadata(name), "{name}");
        }
        for name in ["metadata.json", "schema.json", "part-0.avro", "x-m.avro", "x-mo.avro", "readme.txt", ""] {
            assert!(!is_iceberg_metadata(name), "{name}");
        }
    }

    #[test]
    fn the_table_above_is_found_only_from_a_directory_named_data() {
        assert_eq!(iceberg_table_above("/w/t/data/"), Some("/w/t/"));
        assert_eq!(iceberg_table_above("s3://b/t/data/"), Some("s3://b/t/"));
        assert_eq!(iceberg_table_above("data/"), Some(""));
        assert_eq!(iceberg_table_above("/w/mydata/"), None);
        assert_eq!(iceberg_table_above("/w/data/x/"), None);
    }
}
