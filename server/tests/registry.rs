//! The dataset registry's bounds on real directories of real TAR shards: concurrent opens of one
//! dataset build one index, a second open does not list or stat the shards again, a brace
//! pattern stats only the files it names, and unused datasets are evicted past the bounds while
//! datasets in use stay.

use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Barrier};

use shardstream::index::{Backends, Registry, RegistryLimits};
use shardstream::metrics::thread_local_metadata_calls;

/// Writes `shards` TARs of `per_shard` samples named `part-NNNN.tar`.
fn write_shards(dir: &Path, shards: usize, per_shard: usize) {
    std::fs::create_dir_all(dir).unwrap();
    for s in 0..shards {
        let f = std::fs::File::create(dir.join(format!("part-{s:04}.tar"))).unwrap();
        let mut b = tar::Builder::new(f);
        for i in 0..per_shard {
            let data = format!("sample {s} {i}").into_bytes();
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, format!("k{s:04}_{i:04}.txt"), data.as_slice()).unwrap();
        }
        b.finish().unwrap();
    }
}

fn registry(tmp: &Path, limits: RegistryLimits) -> Registry {
    Registry::with_limits(Some(tmp.join("cache")), Arc::new(Backends::local()), limits)
}

/// (listings, stats) the calling thread makes while running `f`.
fn metadata_calls<T>(f: impl FnOnce() -> T) -> (T, (u64, u64)) {
    let (l0, s0) = thread_local_metadata_calls();
    let out = f();
    let (l1, s1) = thread_local_metadata_calls();
    (out, (l1 - l0, s1 - s0))
}

#[test]
fn sixteen_concurrent_opens_build_one_index() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    // Enough shards that the index build takes a while and the opens overlap it.
    write_shards(&data, 300, 20);
    let reg = Arc::new(registry(tmp.path(), RegistryLimits::default()));
    let barrier = Arc::new(Barrier::new(16));
    let url = data.display().to_string();
    let opened: Vec<_> = (0..16)
        .map(|_| {
            let (reg, barrier, url) = (reg.clone(), barrier.clone(), url.clone());
            std::thread::spawn(move || {
                barrier.wait();
                reg.open(&url, "").unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    assert_eq!(reg.stats.builds.load(Relaxed), 1, "one index build for 16 concurrent opens");
    assert_eq!(reg.stats.opens.load(Relaxed), 16);
    assert!(opened.iter().all(|d| Arc::ptr_eq(d, &opened[0])), "every open shares the one dataset");
    assert_eq!(opened[0].num_samples(), 300 * 20);
    assert_eq!(reg.len(), 1);
}

#[test]
fn concurrent_opens_of_a_missing_dataset_all_fail_with_the_same_error() {
    let tmp = tempfile::tempdir().unwrap();
    let reg = Arc::new(registry(tmp.path(), RegistryLimits::default()));
    let url = tmp.path().join("nowhere").display().to_string();
    let barrier = Arc::new(Barrier::new(8));
    let errors: Vec<String> = (0..8)
        .map(|_| {
            let (reg, barrier, url) = (reg.clone(), barrier.clone(), url.clone());
            std::thread::spawn(move || {
                barrier.wait();
                reg.open(&url, "").unwrap_err().to_string()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    assert!(errors.iter().all(|e| e.contains("not found") && e.contains("nowhere")), "{errors:?}");
    assert!(reg.is_empty());
    assert_eq!(reg.stats.builds.load(Relaxed), 0);
}

#[test]
fn a_second_open_does_not_list_or_stat_every_shard() {
    let tmp = tempfile::tempdir().unwrap();
    // Not `data/`: a directory of that name is also looked at for an Iceberg table's
    // `metadata/` beside it (one more listing, `storage::table_log`).
    let data = tmp.path().join("shards");
    write_shards(&data, 60, 3);
    let reg = registry(tmp.path(), RegistryLimits::default());
    let url = data.display().to_string();
    let (first, (lists, stats)) = metadata_calls(|| reg.open(&url, "").unwrap());
    assert_eq!(lists, 1);
    assert!(stats >= 60, "the first open stats every shard ({stats} stats)");
    let (second, (lists, stats)) = metadata_calls(|| reg.open(&url, "").unwrap());
    assert!(Arc::ptr_eq(&first, &second));
    assert_eq!(
        (lists, stats),
        (0, 2 + 8),
        "a known, unchanged dataset: the directory, its manifest, and 8 shards spread over it"
    );
    assert_eq!(reg.stats.builds.load(Relaxed), 1);

    // A new shard moves the directory's mtime: the next open lists again and sees it.
    std::thread::sleep(std::time::Duration::from_millis(20));
    write_shards(&tmp.path().join("more"), 1, 3);
    std::fs::rename(tmp.path().join("more/part-0000.tar"), data.join("part-0060.tar")).unwrap();
    let (third, (lists, _)) = metadata_calls(|| reg.open(&url, "").unwrap());
    assert_eq!(lists, 1);
    assert_eq!(third.shards.len(), 61);
    assert_eq!(reg.stats.builds.load(Relaxed), 2);
}

#[test]
fn spellings_of_one_directory_share_one_dataset() {
    // `status` listed each spelling a trainer had used as a dataset of its own, each with its
    // own listing and index.
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("shards");
    write_shards(&data, 4, 3);
    let reg = registry(tmp.path(), RegistryLimits::default());
    let url = data.display().to_string();
    let first = reg.open(&url, "").unwrap();
    let parent = tmp.path().display().to_string();
    for other in [format!("{url}/"), format!("{parent}//./shards"), format!("file://{url}")] {
        assert!(Arc::ptr_eq(&first, &reg.open(&other, "").unwrap()), "{other}");
    }
    assert_eq!((reg.len(), reg.stats.builds.load(Relaxed)), (1, 1));
}

#[test]
fn a_brace_pattern_stats_only_the_files_it_names() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    write_shards(&data, 40, 2);
    // Plenty of unrelated entries: a listing would have to stat them.
    for i in 0..500 {
        std::fs::write(data.join(format!("other-{i}.bin")), b"x").unwrap();
    }
    let reg = registry(tmp.path(), RegistryLimits::default());
    let url = format!("{}/part-{{0003..0007}}.tar", data.display());
    let (ds, (lists, stats)) = metadata_calls(|| reg.open(&url, "").unwrap());
    assert_eq!(ds.shards.len(), 5);
    assert_eq!(ds.num_samples(), 10);
    assert_eq!(lists, 0, "a brace pattern never lists the directory");
    // The registry's directory + manifest check, the directory, and the five named files.
    assert_eq!(stats, 2 + 1 + 5);
    let missing = format!("{}/part-{{0038..0041}}.tar", data.display());
    let err = reg.open(&missing, "").unwrap_err().to_string();
    assert!(err.contains("part-0040.tar"), "{err}");
}

#[test]
fn unused_datasets_are_evicted_least_recent_first_and_datasets_in_use_stay() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs: Vec<String> = (0..4)
        .map(|i| {
            let d = tmp.path().join(format!("d{i}"));
            write_shards(&d, 2, 2);
            d.display().to_string()
        })
        .collect();
    let reg = registry(tmp.path(), RegistryLimits { max_datasets: 2, ..RegistryLimits::default() });
    let held = reg.open(&dirs[0], "").unwrap(); // in use all along
    reg.open(&dirs[1], "").unwrap();
    reg.open(&dirs[2], "").unwrap();
    assert_eq!(reg.len(), 2);
    assert_eq!(reg.stats.evictions.load(Relaxed), 1);
    let urls: Vec<String> = reg.all().iter().map(|d| d.url.clone()).collect();
    assert!(urls.contains(&dirs[0]), "the dataset in use stays: {urls:?}");
    assert!(urls.contains(&dirs[2]), "the most recent stays: {urls:?}");
    // Held datasets can exceed the bound (nothing else to evict), never a dataset in use dropped.
    let also_held = reg.open(&dirs[3], "").unwrap();
    assert_eq!(reg.len(), 2);
    drop(held);
    let again = reg.open(&dirs[1], "").unwrap();
    assert_eq!(reg.len(), 2);
    let urls: Vec<String> = reg.all().iter().map(|d| d.url.clone()).collect();
    assert!(urls.contains(&dirs[3]) && urls.contains(&dirs[1]), "{urls:?}");
    drop((also_held, again));
    // A byte bound smaller than one dataset keeps only the dataset just opened (it is in use
    // while its open returns) and what streams hold.
    let tiny = registry(tmp.path(), RegistryLimits { max_datasets: 64, max_index_bytes: 1 });
    drop(tiny.open(&dirs[0], "").unwrap());
    tiny.open(&dirs[1], "").unwrap();
    let urls: Vec<String> = tiny.all().iter().map(|d| d.url.clone()).collect();
    assert_eq!(urls, [dirs[1].clone()]);
}
