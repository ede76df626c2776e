//! Filling a cache file from a shard's source: parallel ranged GETs from S3, or a copy from a
//! local / parallel file system (`cache=copy`). Whatever the source, the bytes are verified
//! before the cache publishes them: the size always, the CRC-32C when the manifest gives one
//! (computed while the bytes stream in, so verification costs no second read), the CRC-32C of a
//! Parquet file's footer when the manifest gives that instead (one tail read of the copy, from the
//! page cache), and for an S3 object without a whole-file CRC, its ETag when that is an MD5 (one read back from the page cache; see
//! `S3Store::download_checked`). A Parquet copy that neither covers (an SSE-KMS ETag, a local
//! copy, a manifest of footer CRCs) has its pages' own checksums checked, where the writer gave
//! them (`format::parquet::pages::check_crcs_with`; headers only for pages without one). A
//! mismatch is fetched again (a bit flip in transit should not fail a training run), up to
//! [`MAX_CHECKSUM_FETCHES`] fetches; the last mismatch is final and names the shard.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use crate::storage::ShardSource;
use crate::storage::s3::{DownloadObserver, ObjectRef, S3Store};
use crate::{Error, Result};

/// Fetches of a shard whose CRC-32C mismatches before it is reported: a byte corrupted in transit
/// is rare and random (the chaos suite injects one per ~40 GETs and sees repeats), a changed
/// object mismatches every time.
const MAX_CHECKSUM_FETCHES: u32 = 3;

/// Read size of a local copy: large enough that syscalls vanish against the copy.
const COPY_CHUNK: usize = 4 << 20;

/// What to fetch and how to check it.
#[derive(Debug, Clone)]
pub struct FetchSpec<'a> {
    pub source: &'a ShardSource,
    pub len: u64,
    /// The object's LastModified as listed (S3; see `ObjectRef::modified_ns`).
    pub modified_ns: Option<i64>,
    pub crc32c: Option<u32>,
    /// CRC-32C of a Parquet file's footer (a `crc32c-footer` manifest), checked on the copy.
    pub footer_crc32c: Option<u32>,
    /// A Parquet file: when nothing checks the copy as a whole (no whole-file CRC-32C, no MD5
    /// ETag), its pages' checksums are checked.
    pub parquet: bool,
}

/// Writes the shard into `file` (a fresh temporary file at `tmp`) and verifies it.
pub fn fill(
    spec: &FetchSpec<'_>,
    store: Option<&S3Store>,
    tmp: &Path,
    file: &File,
    observer: Arc<dyn DownloadObserver>,
) -> Result<()> {
    let url = spec.source.url();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let (crc, md5_checked) = match spec.source {
            ShardSource::S3 { bucket, key, etag } => {
                let store = store.ok_or_else(|| Error::Internal(format!("{url}: no S3 connection")))?;
                let obj = ObjectRef {
                    bucket: bucket.clone(),
                    key: key.clone(),
                    len: spec.len,
                    etag: etag.clone(),
                    modified_ns: spec.modified_ns,
                };
                let shared = Arc::new(file.try_clone().map_err(|e| Error::io("cannot reopen", tmp, e))?);
                // A manifest's CRC-32C is checked below; without one the ETag's MD5 is.
                store.block_on(store.download_checked(&obj, shared, tmp, observer.clone(), spec.crc32c.is_none()))?
            }
            ShardSource::Local(path) => (copy(path, file, tmp, spec.len)?, false),
        };
        let written = file.metadata().map_err(|e| Error::io("cannot stat", tmp, e))?.len();
        if written != spec.len {
            return Err(Error::Shard {
                shard: url,
                offset: Some(written),
                reason: format!("is {written} bytes but {} were expected; refusing to cache it", spec.len),
            });
        }
        let (crc, what) = match spec.footer_crc32c {
            Some(_) => (copy_footer_crc(file, tmp, spec.len, &url)?, "the footer's crc32c"),
            None => (crc, "crc32c"),
        };
        let mismatch = match spec.crc32c.or(spec.footer_crc32c) {
            Some(expected) if expected != crc => Some(format!(
                "{what} {crc:08x} does not match manifest.json ({expected:08x}), also after {} re-fetches: the \
                 object changed after the manifest was written; refusing to serve it",
                MAX_CHECKSUM_FETCHES - 1
            )),
            // Neither a whole-file CRC nor an MD5 covered the copy: the pages' own checksums do.
            _ if spec.parquet && spec.crc32c.is_none() && !md5_checked => {
                copy_pages_fail(file, tmp, spec.len).map_err(|e| Error::io("cannot read back", tmp, e))?.map(|why| {
                    format!("{why}, also after {} re-fetches: the object's bytes are damaged", MAX_CHECKSUM_FETCHES - 1)
                })
            }
            _ => None,
        };
        match mismatch {
            Some(_) if attempt < MAX_CHECKSUM_FETCHES => {
                tracing::warn!(shard = %url, "checksum mismatch after download, fetching once more");
                file.set_len(0).map_err(|e| Error::io("cannot truncate", tmp, e))?;
            }
            Some(reason) => return Err(Error::Shard { shard: url, offset: None, reason }),
            None => return Ok(()),
        }
    }
}

/// Why the pages of the Parquet copy in `file` (`len` bytes) fail their checksums
/// ([`pages::check_crcs_with`](crate::format::parquet::pages::check_crcs_with), every column
/// chunk the copy's own footer names), or None (also when the footer cannot be decoded); an
/// error only when the copy cannot be read.
fn copy_pages_fail(file: &File, tmp: &Path, len: u64) -> std::io::Result<Option<String>> {
    use crate::format::parquet::{ParquetError, ParquetTable, footer, pages};
    let mut unreadable: Option<std::io::Error> = None;
    let mut read_at = |off: u64, buf: &mut [u8]| match file.read_exact_at(buf, off) {
        Ok(()) => Ok(()),
        Err(e) => {
            let said = format!("{}: {e}", tmp.display());
            unreadable = Some(e);
            Err(said)
        }
    };
    let table = footer::read_footer(len, |off, buf| read_at(off, buf).map_err(ParquetError::Io))
        .and_then(|f| ParquetTable::decode(&f, len));
    let failed = match table {
        // Not this check's to report: the table's load names what is wrong with the footer, and
        // a footer spoilt in transit differs from the one the dataset was opened with.
        Err(_) => None,
        Ok(ref t) => (0..t.num_row_groups())
            .flat_map(|rg| {
                let cols = t.reader_metadata().metadata().row_group(rg).num_columns();
                (0..cols).filter_map(move |c| t.chunk_range(rg, c))
            })
            .find_map(|r| {
                pages::check_crcs_with(r.end - r.start, r.start, |from, buf| read_at(r.start + from, buf))
                    .err()
                    .map(|e| format!("column chunk at byte {}: {e}", r.start))
            }),
    };
    match unreadable {
        Some(e) => Err(e),
        None => Ok(failed),
    }
}

/// The footer CRC-32C of the Parquet copy in `file` (`len` bytes, named `url` in errors).
fn copy_footer_crc(file: &File, tmp: &Path, len: u64, url: &str) -> Result<u32> {
    use crate::format::parquet::{ParquetError, footer};
    let footer = footer::read_footer(len, |off, buf| {
        file.read_exact_at(buf, off).map_err(|e| ParquetError::Io(format!("{}: {e}", tmp.display())))
    })
    .map_err(|e| e.into_error(url))?;
    Ok(footer::footer_crc32c(&footer))
}

/// Copies a local shard into the cache file, returning the CRC-32C of what was copied.
///
/// Through a buffer, in writes of [`COPY_CHUNK`], not by the kernel (`copy_file_range`): the
/// kernel's copy goes through a 64 KiB pipe and leaves the copy in small page-cache folios, which
/// every later epoch's mappings then fault in 16 pages at a time. Large writes leave large folios.
/// On this project's VM the kernel's copy made the copying epoch 2x faster and the epochs after
/// it 17% slower (bench/PARQUET_PROFILE.md, "folio sizes").
///
/// The copy takes the source's modification time (as read when it was opened): a dataset whose
/// manifest names its shards by CRC alone tells a copy made before its source was modified by
/// that time (`index::Dataset::shard_fetched`).
fn copy(src: &Path, file: &File, tmp: &Path, len: u64) -> Result<u32> {
    // Not a plain open: a FIFO in a shard's place would block the fill forever.
    let mut from = crate::storage::local::open_regular(src)?;
    let modified = from.metadata().and_then(|m| m.modified()).map_err(|e| Error::io("cannot stat shard", src, e))?;
    let mut buf = vec![0u8; COPY_CHUNK];
    let (mut pos, mut crc) = (0u64, 0u32);
    loop {
        fail_point!("cache-copy-read", |a| Err(crate::failpoints::io("cannot read shard", src, a)));
        let n = from.read(&mut buf).map_err(|e| Error::io("cannot read shard", src, e))?;
        if n == 0 || pos >= len {
            break;
        }
        // Never copy past the indexed length: a shard that grew is reported by its checksum.
        let n = n.min((len - pos) as usize);
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        file.write_all_at(&buf[..n], pos).map_err(|e| Error::io("cannot write", tmp, e))?;
        pos += n as u64;
    }
    crate::metrics::storage_bytes("local", pos);
    if let Err(e) = file.set_modified(modified) {
        // Not the copy's failure: without the time, its source is checked against the manifest
        // again (once per open) instead of by one stat.
        tracing::warn!(copy = %tmp.display(), error = %e, "cannot give a node-cache copy its source's modification time");
    }
    Ok(crc)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local_spec(source: &ShardSource, len: u64, crc32c: Option<u32>) -> FetchSpec<'_> {
        FetchSpec { source, len, modified_ns: None, crc32c, footer_crc32c: None, parquet: false }
    }

    /// Bytes no two chunks of the copy share, so a chunk written twice or skipped shows.
    fn numbered(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 ^ (i >> 20) as u8).collect()
    }

    #[test]
    fn a_local_copy_takes_the_indexed_length_and_checks_its_crc() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = numbered(2 * COPY_CHUNK + 12_345);
        let src = dir.path().join("a.tar");
        std::fs::write(&src, &bytes).unwrap();
        let source = ShardSource::Local(src);
        let len = bytes.len() - 345;
        let tmp = dir.path().join("copy");
        let file = File::options().read(true).write(true).create_new(true).open(&tmp).unwrap();
        let spec = local_spec(&source, len as u64, Some(crc32c::crc32c(&bytes[..len])));
        fill(&spec, None, &tmp, &file, Arc::new(())).unwrap();
        assert_eq!(std::fs::read(&tmp).unwrap(), &bytes[..len]);
    }

    #[test]
    fn a_local_copy_fetched_again_starts_from_the_beginning() {
        // A checksum mismatch truncates the cache file and copies once more.
        let dir = tempfile::tempdir().unwrap();
        let bytes = numbered(100_000);
        let src = dir.path().join("a.tar");
        std::fs::write(&src, &bytes).unwrap();
        let tmp = dir.path().join("copy");
        let file = File::options().read(true).write(true).create_new(true).open(&tmp).unwrap();
        copy(&src, &file, &tmp, bytes.len() as u64).unwrap();
        file.set_len(0).unwrap();
        copy(&src, &file, &tmp, bytes.len() as u64).unwrap();
        assert_eq!(std::fs::read(&tmp).unwrap(), bytes);
    }

    #[test]
    fn a_local_copy_whose_crc_never_matches_is_a_shard_error() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("a.tar");
        std::fs::write(&src, numbered(5_000)).unwrap();
        let source = ShardSource::Local(src.clone());
        let tmp = dir.path().join("copy");
        let file = File::options().read(true).write(true).create_new(true).open(&tmp).unwrap();
        let err = fill(&local_spec(&source, 5_000, Some(1)), None, &tmp, &file, Arc::new(())).unwrap_err();
        assert!(matches!(err, Error::Shard { .. }), "{err:?}");
        assert!(err.to_string().contains("does not match"), "{err}");
        assert_eq!(std::fs::metadata(&tmp).unwrap().len(), 5_000, "every fetch starts from the beginning");
    }

    #[test]
    fn a_shard_shorter_than_indexed_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("a.tar");
        std::fs::write(&src, numbered(1_000)).unwrap();
        let source = ShardSource::Local(src);
        let tmp = dir.path().join("copy");
        let file = File::options().read(true).write(true).create_new(true).open(&tmp).unwrap();
        let err = fill(&local_spec(&source, 2_000, None), None, &tmp, &file, Arc::new(())).unwrap_err();
        assert!(err.to_string().contains("is 1000 bytes but 2000 were expected"), "{err}");
    }
}
