//! Prints, as JSON, how much memory the dataset index takes per sample: the dataset-wide part
//! (prefix sums over shards) and the member tables of every shard loaded at once (the worst case:
//! normally only the shards in use are resident). Used by `make bench`.
//!
//! Usage: `index_memory DATASET_URL`

fn main() -> anyhow::Result<()> {
    let url = std::env::args().nth(1).ok_or_else(|| anyhow::anyhow!("usage: index_memory DATASET_URL"))?;
    let cache = tempfile_dir()?;
    let ds = shardstream::index::Dataset::open(&url, Some(&cache))?;
    for i in 0..ds.shards.len() {
        ds.shard(i)?;
    }
    let (tables, table_bytes) = ds.resident();
    let samples = ds.num_samples().max(1);
    let dataset_wide = (ds.shards.len() + 1) * std::mem::size_of::<u64>();
    println!(
        "{}",
        serde_json::json!({
            "samples": ds.num_samples(),
            "shards": ds.shards.len(),
            "resident_tables": tables,
            "table_bytes": table_bytes,
            "dataset_wide_bytes": dataset_wide,
            "bytes_per_sample": (table_bytes + dataset_wide) as f64 / samples as f64,
            "key_strings_resident": false,
        })
    );
    let _ = std::fs::remove_dir_all(&cache);
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("shardstream-index-memory-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
