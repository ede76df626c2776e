//! Places that are tables with a log of their own, whose files are not their rows: a Delta Lake
//! table keeps in its directory the Parquet files that an overwrite, DELETE or UPDATE removed,
//! until VACUUM deletes them, and only its `_delta_log/` says which files are current. Listed as
//! a directory of shards, its epoch would serve removed rows beside the current ones (as
//! `pyarrow.dataset` on the same directory does), so a listing of one is refused; a glob or named
//! files serve them knowingly.

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
