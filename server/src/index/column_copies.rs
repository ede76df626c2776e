//! S3 Parquet files read by column chunks (`service::projected`): each file's compact copy of the
//! selected chunks, fetched by ranged GETs and checked before the node cache publishes it, and
//! each file's footer, checked once before any of its rows is served.
//!
//! No ETag or manifest checksum covers a range, so a copy is checked by what the file carries:
//! its footer (against the manifest's CRC-32C, else the footer the dataset was opened with) and
//! its pages' CRC-32s where the writer gave them (pyarrow's `write_page_checksum`). A copy that
//! fails either is fetched again, up to [`FETCHES`] times in all, as a whole shard whose bytes
//! miss their CRC or MD5 is: a byte spoilt in transit is rare and random, a file that fails
//! every time is damaged (or changed) at its source, and is reported so. Pages without a
//! checksum (pyarrow's default) cannot be checked: their bytes are as good as the transport
//! (TLS, for S3 over HTTPS). A copy of a whole file ([`ProjectedFile::whole`]) whose GETs answer
//! an ETag that is its MD5 is checked against it instead, every byte, as a whole download is.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::Ordering;

use super::integrity::footer_mismatch;
use super::{Dataset, ShardMeta, named_in_cache, s3_object};
use crate::cache::key::KeyRef;
use crate::cache::{Pin, Want};
use crate::format::parquet::projected::ProjectedFile;
use crate::storage::s3::{ObjectRef, S3Store};
use crate::{Error, Result};

/// Largest ranged GET of a column-chunk copy: a piece larger than this (one column of a huge row
/// group) is fetched in parts, so no GET holds more than this in memory.
pub const PROJECTED_GET: u64 = 8 << 20;

impl Dataset {
    /// Fetches the pieces `pf` of S3 Parquet file `i` into the node cache entry `key` (ranged
    /// GETs of at most [`PROJECTED_GET`] bytes, all at once, `If-Match` on the file's ETag when
    /// known), or pins it there. A fetch also checks the file's footer (`check_footer`)
    /// unless it was checked already, and publishes nothing if it does not match. `Ok(None)`: a
    /// prefetch that did not wait. Blocking.
    pub fn fetch_projected(&self, i: usize, pf: &ProjectedFile, key: KeyRef<'_>, want: Want) -> Result<Option<Pin>> {
        let cache =
            self.backends.cache.as_ref().ok_or_else(|| Error::Internal(format!("{}: no node cache", self.url)))?;
        let meta = self.shards.get(i).ok_or_else(|| Error::Internal(format!("no shard {i}")))?;
        let check = !self.footer_verified(i);
        cache
            .get(key, pf.len(), want, &mut |tmp, file| self.fill_checked(i, pf, check, tmp, file))
            .map_err(|e| named_in_cache(e, meta))
            .map_err(|e| if pf.is_whole() { self.how_row_groups_could_go_apart(i, e) } else { e })
    }

    /// Fetches the pieces `pf` of S3 Parquet file `i` once more, with every check of
    /// [`Self::fetch_projected`], into a file that no other read sees (a temporary of the node
    /// cache's entry `key`, gone once fetched: the descriptor returned keeps its bytes). What a
    /// read whose cached copy does not decode takes when that copy cannot be dropped (another
    /// read holds it). Blocking.
    pub fn fetch_projected_apart(&self, i: usize, pf: &ProjectedFile, key: &str) -> Result<std::fs::File> {
        let cache =
            self.backends.cache.as_ref().ok_or_else(|| Error::Internal(format!("{}: no node cache", self.url)))?;
        let dest = cache.path_of(key);
        // Named as a fill's temporary: start-up deletes one a crash left behind.
        let tmp = crate::atomic_write::AtomicFile::create(&dest)
            .map_err(|e| Error::io("cannot create a temporary copy", &dest, e))?;
        self.fill_checked(i, pf, true, tmp.temp_path(), tmp.file())?;
        tmp.file().try_clone().map_err(|e| Error::io("cannot open a temporary copy", tmp.temp_path(), e))
    }

    /// The whole of S3 Parquet file `i` fetched as [`Self::fetch_projected_apart`] fetches a
    /// copy: by ranged GETs, checked by its footer, its MD5 when its ETag is one, else its pages.
    /// None for a file that is no S3 object read through the node cache.
    pub fn fetch_whole_apart(&self, i: usize) -> Result<Option<std::fs::File>> {
        let (Some(meta), Some(key)) = (self.shards.get(i), self.cache_key(i)) else { return Ok(None) };
        if s3_object(meta).is_err() {
            return Ok(None);
        }
        let (_, table) = self.parquet_file(i)?;
        self.fetch_projected_apart(i, &ProjectedFile::whole(table), key).map(Some)
    }

    /// Fetches the pieces `pf` of S3 Parquet file `i` into `file` (`tmp`), checked (the footer
    /// too when `check`), fetching again on a mismatch up to [`FETCHES`] times in all.
    fn fill_checked(&self, i: usize, pf: &ProjectedFile, check: bool, tmp: &Path, file: &std::fs::File) -> Result<()> {
        let meta = self.shards.get(i).ok_or_else(|| Error::Internal(format!("no shard {i}")))?;
        let obj = s3_object(meta)?;
        let store = self.backends.s3()?;
        let footer = self.footer_range(i)?;
        let gets = copy_gets(pf.pieces(), &footer, check, PROJECTED_GET);
        let ranges: Vec<Range<u64>> = gets.iter().map(|(r, _, _)| r.clone()).collect();
        let copy = CopyGets { i, meta, obj: &obj, store, gets: &gets, ranges: &ranges, footer: &footer, check, pf };
        for fetch in 1..=FETCHES {
            match self.fill_copy(&copy, tmp, file) {
                Ok(()) => break,
                Err(Fill::Mismatch(e)) if fetch < FETCHES => {
                    tracing::warn!(shard = %meta.url(), fetch, error = %e, "column chunks failed their check; fetching them again");
                }
                Err(Fill::Mismatch(e)) => return Err(in_fetches(e)),
                Err(Fill::Failed(e)) => return Err(e),
            }
        }
        if check {
            self.verified[i].store(true, Ordering::Release);
        }
        Ok(())
    }

    /// One fetch of a compact copy into `file` (`tmp`): every GET, the footer's check when asked,
    /// then the pages' checksums.
    fn fill_copy(&self, c: &CopyGets<'_>, tmp: &Path, file: &std::fs::File) -> std::result::Result<(), Fill> {
        use std::os::unix::fs::FileExt;
        let url = || c.meta.url();
        let mut footer_seen = !c.check;
        let mut mismatch: Option<Error> = None;
        let answered = c
            .store
            .block_on(c.store.get_ranges(c.obj, c.ranges, |g, bytes| {
                let (r, at, keep) =
                    c.gets.get(g).ok_or_else(|| Error::Internal(format!("{}: no GET {g} of the copy", url())))?;
                let short = || Error::Internal(format!("{}: GET {g} of the copy came back short", url()));
                let keep = usize::try_from(*keep).map_err(|_| short())?;
                let piece = bytes.get(..keep).ok_or_else(short)?;
                // A GET of the footer alone puts nothing in the copy.
                if !piece.is_empty() {
                    file.write_all_at(piece, *at).map_err(|e| Error::io("cannot write", tmp, e))?;
                }
                // (A whole file's footer across two GETs is read by a GET of its own too.)
                if c.check && r.end == c.footer.end && r.start <= c.footer.start {
                    let from = usize::try_from(c.footer.start - r.start).map_err(|_| short())?;
                    // Noted, not returned: the other GETs go on, and the fetch is tried again.
                    if let Err(e) = self.check_footer(c.i, bytes.get(from..).ok_or_else(short)?) {
                        mismatch.get_or_insert(e);
                    }
                    footer_seen = true;
                }
                Ok(())
            }))
            .map_err(Fill::Failed)?;
        if let Some(e) = mismatch {
            return Err(Fill::Mismatch(e));
        }
        if !footer_seen {
            return Err(Fill::Failed(Error::Internal(format!("{}: no GET of the copy read its footer", url()))));
        }
        // A whole file's copy is checked whole when its ETag is an MD5 (a one-part upload's), as a
        // download of it is: every byte, pages with checksums or not.
        if let Some(want) = answered.md5(c.obj).filter(|_| c.pf.is_whole()) {
            let got = crate::storage::s3::file_md5(file, c.pf.len())
                .map_err(|e| Fill::Failed(Error::io("cannot read back", tmp, e)))?;
            if got != want {
                return Err(Fill::Mismatch(Error::Shard {
                    shard: url(),
                    offset: None,
                    reason: "the downloaded bytes do not match the object's ETag (MD5)".into(),
                }));
            }
            return Ok(());
        }
        let mut unreadable: Option<std::io::Error> = None;
        let pages = c.pf.check_pages(|at, buf| {
            file.read_exact_at(buf, at).map_err(|e| {
                let said = e.to_string();
                unreadable = Some(e);
                said
            })
        });
        match (pages, unreadable) {
            (Ok(unchecked), _) => {
                if unchecked > 0 {
                    self.note_unchecked_pages(c.i, unchecked);
                }
                Ok(())
            }
            (Err(_), Some(e)) => Err(Fill::Failed(Error::io("cannot read back", tmp, e))),
            (Err(reason), None) => Err(Fill::Mismatch(Error::Shard { shard: url(), offset: None, reason })),
        }
    }

    /// Checks S3 Parquet file `i`'s footer once before its rows are served from column-chunk
    /// copies (`check_footer`): a no-op when the fetch of its copy checked it, else one
    /// ranged GET of exactly the footer.
    pub fn verify_remote_footer(&self, i: usize) -> Result<()> {
        if self.footer_verified(i) {
            return Ok(());
        }
        // Streams building batches at once check a file once, not once each.
        let lock = self.load_locks.get(i).ok_or_else(|| Error::Internal(format!("shard {i} out of range")))?;
        let _checking = lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.verified[i].load(Ordering::Acquire) {
            return Ok(());
        }
        let meta = self.shards.get(i).ok_or_else(|| Error::Internal(format!("no shard {i}")))?;
        let obj = s3_object(meta)?;
        let tail = self.footer_range(i)?.start;
        let s3 = self.backends.s3()?;
        for fetch in 1..=FETCHES {
            let (bytes, _) = s3.block_on(s3.get_range(&obj, tail..meta.len))?;
            match self.check_footer(i, &bytes) {
                Ok(()) => break,
                Err(e) if fetch < FETCHES => {
                    tracing::warn!(shard = %meta.url(), fetch, error = %e, "a footer failed its check; reading it again");
                }
                Err(e) => return Err(in_fetches(e)),
            }
        }
        self.verified[i].store(true, Ordering::Release);
        Ok(())
    }

    /// The bytes of S3 Parquet file `i` that [`Self::check_footer`] checks: its footer, its length
    /// and magic, as the dataset knows them.
    pub(super) fn footer_range(&self, i: usize) -> Result<std::ops::Range<u64>> {
        let (meta, table) = self.parquet_file(i)?;
        Ok(meta.len.saturating_sub(table.footer_bytes() + crate::format::parquet::footer::FOOTER_TAIL_BYTES)..meta.len)
    }

    /// Shard `i` and the footer table the dataset was opened with.
    pub(super) fn parquet_file(&self, i: usize) -> Result<(&ShardMeta, &crate::format::parquet::ParquetTable)> {
        let meta = self.shards.get(i).ok_or_else(|| Error::Internal(format!("no shard {i}")))?;
        let file = self.parquet.as_ref().and_then(|p| p.files().iter().find(|f| f.index == i));
        let file = file.ok_or_else(|| Error::Internal(format!("{}: no footer table", meta.url())))?;
        Ok((meta, &file.table))
    }

    /// Checks `bytes` (file `i`'s [`Self::footer_range`], as just read from the object): their
    /// CRC is the footer checksum, against the manifest's when there is one, and in any case
    /// against the footer the dataset was opened with (the chunk offsets the decoder uses come
    /// from it). A footer of another length changes the length field it covers.
    pub(super) fn check_footer(&self, i: usize, bytes: &[u8]) -> Result<()> {
        let (meta, table) = self.parquet_file(i)?;
        let opened = table.footer_crc32c();
        let got = crc32c::crc32c(bytes);
        if let Some(expected) = meta.footer_crc32c {
            if got != expected {
                return Err(footer_mismatch(&meta.url(), got, expected, "its footer"));
            }
            if opened != expected {
                return Err(footer_mismatch(&meta.url(), opened, expected, "the footer its table was decoded from"));
            }
        } else if got != opened {
            return Err(Error::Shard {
                shard: meta.url(),
                offset: None,
                reason: format!(
                    "its footer changed since the dataset was opened (crc32c {got:08x}, was {opened:08x}); \
                     refusing to serve it"
                ),
            });
        }
        Ok(())
    }
}

/// Every GET of a copy of `pieces` ([`ProjectedFile::pieces`]): (the bytes of the file, where they
/// go in the copy, how many of them go there: a GET that also reads the footer goes on past its
/// piece), each of at most `most` bytes.
///
/// With `check_footer`, the footer (`footer`) is checked from the GETs that fill the copy, before
/// the copy is published (see `check_footer`): read with the last piece when at most a merge gap
/// separates them (the columns after it), within the last GET of a whole file's copy, else by a
/// GET of its own among the others. A separate GET per file, after the copy, was a fifth of a cold
/// `label` epoch's requests on the bench's set.
fn copy_gets(
    pieces: &[(Range<u64>, u64)],
    footer: &Range<u64>,
    check_footer: bool,
    most: u64,
) -> Vec<(Range<u64>, u64, u64)> {
    let mut gets: Vec<(Range<u64>, u64, u64)> = Vec::new();
    for (range, at) in pieces {
        let mut start = range.start;
        while start < range.end {
            let end = range.end.min(start + most.max(1));
            gets.push((start..end, at + (start - range.start), end - start));
            start = end;
        }
    }
    if check_footer {
        match gets.last_mut() {
            Some((r, _, _)) if r.start <= footer.start && r.end == footer.end => {}
            Some((r, _, _))
                if r.end <= footer.start && footer.start - r.end <= crate::format::parquet::decode::MERGE_GAP =>
            {
                r.end = footer.end;
            }
            _ => gets.push((footer.clone(), 0, 0)),
        }
    }
    gets
}

/// Fetches of a copy (or reads of a footer) before one that fails its check every time is
/// reported: as many as a whole shard's downloads on a checksum mismatch.
const FETCHES: u32 = 3;

/// What one fetch of a copy needs: the file, the store, and the GETs with where their bytes go.
struct CopyGets<'a> {
    i: usize,
    meta: &'a ShardMeta,
    obj: &'a ObjectRef,
    store: &'a S3Store,
    /// (file bytes, offset in the copy, how many of them go there).
    gets: &'a [(std::ops::Range<u64>, u64, u64)],
    ranges: &'a [std::ops::Range<u64>],
    footer: &'a std::ops::Range<u64>,
    /// Whether these GETs check the footer.
    check: bool,
    pf: &'a ProjectedFile,
}

/// Why one fetch of a copy did not make it.
enum Fill {
    /// The bytes arrived and failed a check: a fetch again may get good ones.
    Mismatch(Error),
    /// Anything else (the store's own retries are spent, the disk): not fetched again here.
    Failed(Error),
}

/// A check's error once every fetch has failed it.
fn in_fetches(e: Error) -> Error {
    match e {
        Error::Shard { shard, offset, reason } => Error::Shard {
            shard,
            offset,
            reason: format!("{reason} (in the last of {FETCHES} fetches, each of which failed a check)"),
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::parquet::decode::MERGE_GAP;

    #[test]
    fn a_copy_s_gets_read_its_footer_once_and_never_before_a_get_s_start() {
        const END: u64 = 1_000_000;
        let footer = END - 100..END;
        // A compact copy: two pieces, the last far from the footer, split in GETs of 300 bytes.
        let pieces = [(4..500, 0), (2_000..2_700, 496)];
        let gets = copy_gets(&pieces, &footer, true, 300);
        assert_eq!(
            gets,
            vec![
                (4..304, 0, 300),
                (304..500, 300, 196),
                (2_000..2_300, 496, 300),
                (2_300..2_600, 796, 300),
                (2_600..2_700, 1_096, 100),
                (footer.clone(), 0, 0),
            ]
        );
        assert_eq!(copy_gets(&pieces, &footer, false, 300).len(), 5, "no footer GET when it was checked");
        // The last piece within a merge gap of the footer: its GET reads on to the file's end.
        let near = [(4..footer.start - MERGE_GAP, 0)];
        let gets = copy_gets(&near, &footer, true, 1 << 20);
        assert_eq!(gets, vec![(4..END, 0, footer.start - MERGE_GAP - 4)]);
        // A whole file: its last GET holds the footer, which starts inside it.
        let whole = [(0..END, 0)];
        let gets = copy_gets(&whole, &footer, true, 400_000);
        assert_eq!(
            gets,
            vec![(0..400_000, 0, 400_000), (400_000..800_000, 400_000, 400_000), (800_000..END, 800_000, 200_000)]
        );
        // A whole file whose footer straddles two GETs: the footer has a GET of its own, and the
        // GET that ends the file starts after the footer's start (the fill checks the footer
        // from the one GET that holds it all).
        let gets = copy_gets(&whole, &footer, true, END / 2 - 30);
        let (last, _, _) = &gets[gets.len() - 2];
        assert!(last.end == END && last.start > footer.start, "{gets:?}");
        assert_eq!(gets.last(), Some(&(footer.clone(), 0, 0)));
        let holding = gets.iter().filter(|(r, _, _)| r.start <= footer.start && r.end == footer.end).count();
        assert_eq!(holding, 1, "{gets:?}");
    }
}
