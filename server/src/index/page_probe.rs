//! Whether a row group's copy of an S3 Parquet file is checked as well as a whole copy, read from
//! each file's first page header. It decides how a file read in every column through a node
//! cache too small for the files reaches that cache (`service::projected`): a copy a row group
//! at a time is checked by its pages only, so a file is copied whole when its ETag's MD5 checks
//! every byte there and its pages carry no checksum. One ranged GET per file asked about (the
//! first [`CRC_PROBE_BYTES`] of its first column chunk, room for any page header), many at
//! once, once per dataset: the answers are kept with it (and in the node cache, below). The same
//! GET answers whether the ETag may be an MD5 at all (SSE-KMS says it is not, with an ETag of an
//! MD5's form in the listing).
//!
//! Many files need no GET of their own: the tail read for a file's footer at open often holds a
//! column chunk's first page header (the last row group's chunks, when they are small), and its
//! answer says whether the ETag may be an MD5 ([`tail_page_crc`]); `shardstream index` records
//! the same in the manifest ([`RowGroupCheck::from_facts`]).
//!
//! Each answer read is also kept in the node cache's index directory, beside the file's sidecar
//! and guarded by the object's identity, ETag and modification time: a daemon restarted on its
//! cache (an upgrade, a crash) asks again only about files that changed or are new. One page
//! header speaks for its file (the first's, or one in the tail), for as long as the answer is
//! kept: a file whose writers mixed is logged when a copy meets pages without a checksum.
//!
//! No file is asked about when the store answers over TLS ([`Dataset::answers_over_tls`]): its
//! record MACs check every ranged GET in transit, where a whole copy's MD5 would, the stance
//! column-chunk copies of a projection take for every file. The MD5 also caught bytes spoilt
//! before TLS (by the store, or a TLS-terminating proxy before it) and a wrong joining of ranges;
//! such a copy leaves those to its footer, the page checksums the file has and decoding.

use std::path::Path;
use std::sync::atomic::Ordering;

use super::tables::cache_sidecar_path;
use super::{Dataset, s3_object};
use crate::format::Format;
use crate::format::parquet::ParquetTable;
use crate::format::parquet::pages::{CRC_PROBE_BYTES, header_has_crc};
use crate::storage::ShardSource;
use crate::{Error, Result};

/// How a row group's copy of a file is checked, as its first page header's GET said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowGroupCheck {
    /// Not as well as a whole copy: its MD5 checks a whole copy, its pages carry no checksum (or
    /// the header could not be read or did not say).
    Worse,
    /// By its pages' checksums.
    Pages,
    /// As well as a whole copy, by whatever pages carry checksums: no MD5 checks it whole.
    NoMd5,
}

impl RowGroupCheck {
    const ALL: [Self; 3] = [Self::Worse, Self::Pages, Self::NoMd5];

    /// The answer, when the facts give one: whether a page header of the file carries a CRC
    /// (None: none read, or it did not say), and whether the ETag a GET of it answered may be its
    /// MD5 (None: not known). The probe's GET, the tail read for the footer at open
    /// ([`tail_page_crc`]) and a manifest `shardstream index` wrote from that tail all give these
    /// (a manifest's ETag answer counts only beside its recorded ETag, which pins every GET to
    /// that upload: a footer does not name the upload's form or encryption).
    pub(super) fn from_facts(page_crc: Option<bool>, etag_md5: Option<bool>) -> Option<Self> {
        match (page_crc, etag_md5) {
            (Some(true), _) => Some(Self::Pages),
            (_, Some(false)) => Some(Self::NoMd5),
            (Some(false), Some(true)) => Some(Self::Worse),
            _ => None,
        }
    }

    /// How a kept answer names it.
    fn name(self) -> &'static str {
        match self {
            Self::Worse => "worse",
            Self::Pages => "pages",
            Self::NoMd5 => "no-md5",
        }
    }
}

/// What a Parquet file's tail, the first read of its footer, tells of its row groups' copies:
/// whether its pages carry checksums ([`tail_page_crc`]) and whether the store's ETag may be its
/// MD5 (None for a local file, or when nothing was read).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct TailFacts {
    pub page_crc: Option<bool>,
    pub etag_md5: Option<bool>,
}

/// File `shown_as`'s footer table (`len` bytes), read with `read_at`, which fills the buffer at
/// the offset it is given and says whether the answer's ETag may be the MD5 of the object; and
/// what the first read, its tail, tells ([`TailFacts`]).
pub(super) fn read_table_noting_tail(
    shown_as: &str,
    len: u64,
    mut read_at: impl FnMut(u64, &mut [u8]) -> Result<Option<bool>>,
) -> Result<(ParquetTable, TailFacts)> {
    let mut tail = None;
    let table = crate::format::parquet::dataset::read_table(shown_as, len, |off, buf| {
        let etag_md5 = read_at(off, buf)?;
        tail.get_or_insert_with(|| (off, buf.to_vec(), etag_md5));
        Ok(())
    })?;
    let facts = tail.map_or_else(TailFacts::default, |(at, bytes, etag_md5)| TailFacts {
        page_crc: tail_page_crc(&table, at, &bytes),
        etag_md5,
    });
    Ok((table, facts))
}

/// Whether a page header in `tail` (Parquet file `table`'s bytes from `tail_at`, read for its
/// footer) carries a CRC of its page: the first column chunk from the end that starts there and
/// whose header tells. None when no header in the tail does.
pub(super) fn tail_page_crc(table: &ParquetTable, tail_at: u64, tail: &[u8]) -> Option<bool> {
    // As much of a chunk's start as the probe would read.
    let in_tail = |r: &std::ops::Range<u64>| {
        let rest = tail.get(usize::try_from(r.start.checked_sub(tail_at)?).ok()?..)?;
        let len = usize::try_from((r.end - r.start).min(CRC_PROBE_BYTES)).ok()?;
        rest.get(..len.min(rest.len()))
    };
    (0..table.num_row_groups())
        .rev()
        .flat_map(|rg| (0..).map_while(move |col| table.chunk_range(rg, col)))
        .find_map(|r| header_has_crc(in_tail(&r)?, r.end - r.start))
}

/// The extension of a kept answer's file, beside the file's sidecar (`.idx`).
const KEPT_EXTENSION: &str = "rgcheck";

impl Dataset {
    /// True when the dataset's store answers over TLS ([`crate::storage::s3::S3Store::answers_over_tls`]).
    /// Connects on first use (blocking).
    pub fn answers_over_tls(&self) -> Result<bool> {
        Ok(self.backends.s3()?.answers_over_tls())
    }

    /// For each of S3 Parquet files `files` (shard indexes): true when a copy of one row group's
    /// chunks is checked as well as the whole file's (but for page headers, which nothing
    /// checks): its first page header carries a CRC-32 of its page (writers checksum every page
    /// of a file or none), or its GET answers an ETag that is no MD5 (a multipart upload's,
    /// SSE-KMS, SSE-C: nothing checks it whole). False otherwise, and when the header cannot be
    /// read or does not say. Blocking: one GET per file not asked about before, up to
    /// [`crate::storage::s3::PROBES_IN_FLIGHT`] at once; an error only when the daemon stops.
    pub fn row_group_copies_checked(&self, files: &[usize]) -> Result<Vec<bool>> {
        let said = |i: usize| self.row_group_checked.get(i).and_then(|c| c.get().copied());
        // Two plans built at once (streams, staging) read each header once: the second waits.
        let _probing = self.probing.lock().unwrap_or_else(|p| p.into_inner());
        let (mut reads, mut asked) = (Vec::new(), Vec::new());
        for i in files.iter().copied().filter(|&i| said(i).is_none()) {
            if let Some(kept) = self.kept_answer(i) {
                self.note_row_group_checked(i, kept);
                continue;
            }
            let (meta, table) = self.parquet_file(i)?;
            // The first column chunk that has rows: its first page (a dictionary's, or data).
            match (0..table.num_row_groups()).find_map(|rg| table.chunk_range(rg, 0)) {
                Some(r) => {
                    reads.push((s3_object(meta)?, r.start..r.end.min(r.start + CRC_PROBE_BYTES)));
                    asked.push((i, r.end - r.start));
                }
                None => self.note_row_group_checked(i, RowGroupCheck::Worse),
            }
        }
        if !reads.is_empty() {
            let store = self.backends.s3()?;
            let started = std::time::Instant::now();
            let got = store.block_on(store.get_each(&reads))?;
            let (mut with_crcs, mut no_md5, mut failed) = (0, 0, 0);
            for (&(i, chunk_len), answer) in asked.iter().zip(got) {
                let url = || self.shards.get(i).map(|m| m.url()).unwrap_or_default();
                // Only a choice of copies rides on it: a file whose header cannot be read (or
                // does not say) is copied whole, and its fetch reports what is wrong with it.
                let checked = match answer {
                    Ok((bytes, md5)) => {
                        let crc = header_has_crc(&bytes, chunk_len);
                        if crc.is_none() {
                            tracing::warn!(shard = %url(), "its first page header does not say whether its pages carry checksums; taken as none");
                        }
                        with_crcs += usize::from(crc == Some(true));
                        no_md5 += usize::from(!md5);
                        // A header that did not say may have been spoilt on the way: the file
                        // goes whole here, and the next daemon asks again (nothing is kept).
                        match RowGroupCheck::from_facts(crc, Some(md5)) {
                            Some(checked) => {
                                self.keep_answer(i, checked);
                                checked
                            }
                            None => RowGroupCheck::Worse,
                        }
                    }
                    Err(e) => {
                        failed += 1;
                        tracing::warn!(shard = %url(), error = %e, "cannot read its first page header; copying it whole");
                        RowGroupCheck::Worse
                    }
                };
                self.note_row_group_checked(i, checked);
            }
            tracing::info!(
                dataset = %self.url,
                files = asked.len(),
                with_page_checksums = with_crcs,
                no_md5,
                failed,
                ms = started.elapsed().as_millis() as u64,
                "read files' first page headers: how their row groups' copies are checked"
            );
        }
        Ok(files.iter().map(|&i| said(i).is_some_and(|c| c != RowGroupCheck::Worse)).collect())
    }

    /// Where file `i`'s answer is kept, and what guards it: the file's identity (its sidecar's)
    /// with the object's ETag and modification time, which name its upload and encryption too
    /// (a footer CRC does not: an object copied onto itself to drop SSE-KMS keeps its footer).
    /// None without a node cache, or for an object known by neither: nothing would tell another
    /// upload of those bytes from it.
    fn kept_answer_path(&self, i: usize) -> Option<(std::path::PathBuf, Vec<u8>)> {
        let (dir, meta) = (self.sidecar_cache.as_deref()?, self.shards.get(i)?);
        let ShardSource::S3 { etag, .. } = &meta.source else { return None };
        if etag.is_none() && meta.mtime_ns.is_none() {
            return None;
        }
        let mut guard = meta.identity();
        guard.extend_from_slice(format!(";etag={etag:?};mtime_ns={:?}", meta.mtime_ns).as_bytes());
        Some((cache_sidecar_path(dir, meta).with_extension(KEPT_EXTENSION), guard))
    }

    /// File `i`'s answer kept by an earlier daemon on this cache, when it was kept for the file
    /// as it is now.
    fn kept_answer(&self, i: usize) -> Option<RowGroupCheck> {
        let (path, identity) = self.kept_answer_path(i)?;
        let kept = std::fs::read(&path).ok()?;
        let (answer, for_identity) = kept.split_at(kept.iter().position(|&b| b == b'\n')?);
        if for_identity.get(1..) != Some(identity.as_slice()) {
            return None;
        }
        RowGroupCheck::ALL.into_iter().find(|c| c.name().as_bytes() == answer)
    }

    /// Keeps file `i`'s answer for the next daemon on this cache: written whole or not at all (a
    /// failure only costs that daemon the GET again).
    pub(super) fn keep_answer(&self, i: usize, checked: RowGroupCheck) {
        let Some((path, identity)) = self.kept_answer_path(i) else { return };
        let write = || -> std::io::Result<()> {
            // The directory is there but for a dataset's first answer: made then, not each time.
            let tmp = match crate::atomic_write::AtomicFile::create(&path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
                    crate::atomic_write::AtomicFile::create(&path)?
                }
                made => made?,
            };
            std::io::Write::write_all(&mut tmp.file(), &[checked.name().as_bytes(), b"\n", &identity].concat())?;
            tmp.commit_unsynced()
        };
        if let Err(e) = write() {
            tracing::debug!(path = %path.display(), error = %e, "cannot keep a first page header's answer");
        }
    }

    /// `e`, a node cache's refusal of a whole copy of file `i`, saying how the file's row groups
    /// could have gone apart, where only its MD5 kept it whole: a file of several row groups, no
    /// manifest CRC, no page checksums, over plain HTTP. Any other error as it is.
    pub(super) fn how_row_groups_could_go_apart(&self, i: usize, e: Error) -> Error {
        let Error::CacheFull(m) = e else { return e };
        let md5_only = self.format == Format::Parquet
            && self.shards.get(i).is_some_and(|s| s.crc32c.is_none() && matches!(s.source, ShardSource::S3 { .. }))
            && matches!(self.row_group_checked.get(i).and_then(|c| c.get()), None | Some(RowGroupCheck::Worse))
            && self.parquet_file(i).is_ok_and(|(_, t)| t.num_row_groups() > 1)
            && self.answers_over_tls().is_ok_and(|tls| !tls);
        if !md5_only {
            return Error::CacheFull(m);
        }
        Error::CacheFull(format!(
            "{m}. In a node cache smaller than the dataset's files, every column of a Parquet file \
             whose pages carry no checksum goes whole over plain HTTP (only its MD5 checks its bytes); \
             over an https:// endpoint, or written with page checksums (pyarrow \
             write_page_checksum=True), it goes a row group at a time"
        ))
    }

    pub(super) fn note_row_group_checked(&self, i: usize, checked: RowGroupCheck) {
        if let Some(c) = self.row_group_checked.get(i) {
            // Another stream may have read it meanwhile: the same file, the same answer.
            let _ = c.set(checked);
        }
    }

    /// Notes that a copy of S3 Parquet file `i` held `unchecked` pages without a checksum: said
    /// once per file when its first page header had one, so that its copies went a row group at
    /// a time, where its MD5 would have checked a whole copy (a file whose writers mixed).
    pub(super) fn note_unchecked_pages(&self, i: usize, unchecked: u64) {
        let expected = self.row_group_checked.get(i).and_then(|c| c.get()) == Some(&RowGroupCheck::Pages);
        if expected && self.unchecked_warned.get(i).is_some_and(|w| !w.swap(true, Ordering::Relaxed)) {
            let url = self.shards.get(i).map(|m| m.url()).unwrap_or_default();
            tracing::warn!(
                shard = %url,
                pages = unchecked,
                "pages without a checksum in a file whose first page has one: they are checked by \
                 nothing in its row groups' copies (a whole copy would have been checked by its MD5)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RowGroupCheck::{self, NoMd5, Pages, Worse};

    #[test]
    fn page_checksums_decide_first_then_an_etag_that_is_no_md5_and_nothing_else_decides() {
        let decide = RowGroupCheck::from_facts;
        assert_eq!(decide(Some(true), Some(true)), Some(Pages));
        assert_eq!(decide(Some(true), None), Some(Pages));
        assert_eq!(decide(Some(false), Some(false)), Some(NoMd5));
        assert_eq!(decide(None, Some(false)), Some(NoMd5));
        assert_eq!(decide(Some(false), Some(true)), Some(Worse));
        // A header that did not say, or an ETag not known: asked (the probe), never guessed.
        assert_eq!(decide(None, Some(true)), None);
        assert_eq!(decide(Some(false), None), None);
        assert_eq!(decide(None, None), None);
    }
}
