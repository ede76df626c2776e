//! Failpoint tests at unit level: each trips one `fail_point!` of the storage, cache and sidecar
//! paths and asserts the outcome the `failpoints` module promises: a named error or a transparent
//! retry, never a half-written file left visible, never a hang. Run with
//! `cargo test -p shardstream --features failpoints failpoint` (`make test` does); the points
//! that need a daemon (S3 bodies, shm sends, packed rings, the gRPC stream) are tripped end to end
//! by `tests/test_failpoints.py`.
//!
//! Failpoints are process-global: every test holds a `FailScenario` (a global lock, and the
//! points cleared when it ends), so these tests run one at a time whatever the thread count.
#![cfg(feature = "failpoints")]

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use fail::FailScenario;
use shardstream::cache::download::{FetchSpec, fill};
use shardstream::cache::table::Policy;
use shardstream::cache::{NodeCache, Want};
use shardstream::format::sidecar;
use shardstream::format::tar::TarIndex;
use shardstream::storage::ShardSource;
use shardstream::storage::local::{ShardFile, write_atomic};
use shardstream::{Error, Result};

/// Runs `f` on its own thread and fails the test if it does not return within `limit`: a
/// failpoint must never turn into a hang.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).expect("the operation hung under a failpoint")
}

/// Names of the files in `dir`, sorted.
fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

fn write(bytes: &'static [u8]) -> impl FnMut(&Path, &File) -> Result<()> {
    move |_, mut f: &File| f.write_all(bytes).map_err(|e| Error::io("write", "x", e))
}

fn errno(e: &Error) -> Option<i32> {
    match e {
        Error::Io { source, .. } => source.raw_os_error(),
        _ => None,
    }
}

#[test]
fn failpoint_local_read_fails_naming_the_file_then_reads_again() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train-000000.tar");
    let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let shard = ShardFile::open(path.clone(), bytes.len() as u64).unwrap();
    fail::cfg("local-read", "return(EIO)").unwrap();
    let mut buf = vec![0u8; 512];
    let err = shard.read_exact_at(&mut buf, 1024).unwrap_err();
    assert_eq!(errno(&err), Some(libc::EIO), "{err:?}");
    assert!(err.to_string().contains(&path.display().to_string()), "the error names the file: {err}");
    // The point off, the same open file reads the right bytes: nothing was left broken.
    fail::remove("local-read");
    shard.read_exact_at(&mut buf, 1024).unwrap();
    assert_eq!(buf, bytes[1024..1536]);
    scenario.teardown();
}

#[test]
fn failpoint_cache_fill_enospc_once_is_retried_transparently() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
    fail::cfg("cache-fill", "1*return(ENOSPC)").unwrap();
    let c = cache.clone();
    let pin = within(Duration::from_secs(10), move || c.get("k", 5, Want::NOW, &mut write(b"hello")))
        .expect("one ENOSPC is absorbed by evicting and filling again")
        .expect("a waiting get always returns a pin");
    assert!(pin.filled);
    assert_eq!(std::fs::read(pin.path()).unwrap(), b"hello");
    assert_eq!(files_in(cache.dir()), ["k"], "the failed attempt's temporary file is gone");
    scenario.teardown();
}

#[test]
fn failpoint_cache_fill_disk_full_is_a_named_error_and_leaves_nothing() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
    fail::cfg("cache-fill", "return(ENOSPC)").unwrap();
    let c = cache.clone();
    let err = within(Duration::from_secs(10), move || c.get("k", 5, Want::NOW, &mut write(b"hello"))).unwrap_err();
    assert!(matches!(err, Error::CacheFull(_)), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&cache.dir().display().to_string()) && msg.contains("disk space"), "{msg}");
    assert!(files_in(cache.dir()).is_empty(), "no partial file stays: {:?}", files_in(cache.dir()));
    assert_eq!(cache.stats().used, 0, "the failed fill's reservation is returned");
    // The disk has room again: the same key fills.
    fail::remove("cache-fill");
    let pin = cache.get("k", 5, Want::NOW, &mut write(b"hello")).unwrap().unwrap();
    assert_eq!(std::fs::read(pin.path()).unwrap(), b"hello");
    scenario.teardown();
}

#[test]
fn failpoint_cache_fsync_and_rename_errors_are_named_and_leave_nothing() {
    let scenario = FailScenario::setup();
    for (point, op) in [("cache-fsync", "cannot sync cache file"), ("cache-rename", "cannot publish cache file")] {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        fail::cfg(point, "return(EIO)").unwrap();
        let c = cache.clone();
        let err = within(Duration::from_secs(10), move || c.get("k", 5, Want::NOW, &mut write(b"hello"))).unwrap_err();
        assert_eq!(errno(&err), Some(libc::EIO), "{point}: {err:?}");
        assert!(err.to_string().contains(op), "{point}: {err}");
        assert!(files_in(cache.dir()).is_empty(), "{point}: {:?}", files_in(cache.dir()));
        assert!(!cache.is_present("k"), "{point}: a failed fill is not in the table");
        fail::remove(point);
        let pin = cache.get("k", 5, Want::NOW, &mut write(b"hello")).unwrap().unwrap();
        assert_eq!(std::fs::read(pin.path()).unwrap(), b"hello", "{point}");
    }
    scenario.teardown();
}

#[test]
fn failpoint_local_copy_read_error_names_the_source_shard() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("a.tar");
    std::fs::write(&src, b"0123456789").unwrap();
    let cache = NodeCache::open(&dir.path().join("cache"), Some(100), Policy::Lru).unwrap();
    fail::cfg("cache-copy-read", "return(EIO)").unwrap();
    let source = ShardSource::Local(src.clone());
    let spec = FetchSpec {
        source: &source,
        len: 10,
        modified_ns: None,
        crc32c: Some(crc32c::crc32c(b"0123456789")),
        footer_crc32c: None,
        parquet: false,
    };
    let err = cache
        .get("a", 10, Want::NOW, &mut |tmp: &Path, file: &File| fill(&spec, None, tmp, file, std::sync::Arc::new(())));
    let err = err.unwrap_err();
    assert_eq!(errno(&err), Some(libc::EIO), "{err:?}");
    assert!(err.to_string().contains(&src.display().to_string()), "{err}");
    assert!(files_in(cache.dir()).is_empty());
    fail::remove("cache-copy-read");
    let pin = cache
        .get("a", 10, Want::NOW, &mut |tmp: &Path, file: &File| fill(&spec, None, tmp, file, std::sync::Arc::new(())))
        .unwrap()
        .unwrap();
    assert_eq!(std::fs::read(pin.path()).unwrap(), b"0123456789");
    scenario.teardown();
}

#[test]
fn failpoint_sidecar_write_failure_keeps_the_old_sidecar() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.tar.idx");
    let old = TarIndex {
        boundaries: vec![0, 1024],
        fields: vec!["jpg".into()],
        layout: None,
        split_keys: Default::default(),
    };
    sidecar::write_atomic(&path, b"id", &old).unwrap();
    fail::cfg("sidecar-write", "return(ENOSPC)").unwrap();
    let new = TarIndex {
        boundaries: vec![0, 512, 2048],
        fields: vec!["cls".into()],
        layout: None,
        split_keys: Default::default(),
    };
    let err = sidecar::write_atomic(&path, b"id", &new).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
    assert_eq!(sidecar::read(&path, b"id").unwrap(), Some(old), "readers still see the complete old sidecar");
    assert_eq!(files_in(dir.path()), ["a.tar.idx"]);
    scenario.teardown();
}

#[test]
fn failpoint_atomic_write_failure_names_the_file_and_keeps_the_old_one() {
    let scenario = FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("manifest.json");
    write_atomic(&path, b"old").unwrap();
    fail::cfg("atomic-write", "return(EIO)").unwrap();
    let err = write_atomic(&path, b"new").unwrap_err();
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"old");
    assert_eq!(files_in(dir.path()), ["manifest.json"]);
    scenario.teardown();
}
