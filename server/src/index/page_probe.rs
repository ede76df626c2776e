//! Whether a row group's copy of an S3 Parquet file is checked as well as a whole copy, read from
//! each file's first page header. It decides how a file read in every column through a node
//! cache too small for the files reaches that cache (`service::projected`): a copy a row group
//! at a time is checked by its pages only, so a file is copied whole when its ETag's MD5 checks
//! every byte there and its pages carry no checksum. One ranged GET per file asked about (the
//! first [`CRC_PROBE_BYTES`] of its first column chunk, room for any page header), all at once,
//! once per dataset: the answers are kept with it. The same GET answers whether the ETag may be
//! an MD5 at all (SSE-KMS says it is not, with an ETag of an MD5's form in the listing).

use super::{Dataset, s3_object};
use crate::Result;
use crate::format::parquet::pages::{CRC_PROBE_BYTES, header_has_crc};

impl Dataset {
    /// For each of S3 Parquet files `files` (shard indexes): true when a copy of one row group's
    /// chunks is checked as well as the whole file's: its first page header carries a CRC-32 of
    /// its page (writers checksum every page of a file or none), or its GET answers an ETag that
    /// is no MD5 (SSE-KMS, SSE-C: nothing checks it whole). False otherwise, and when the header
    /// does not say. Blocking: one GET per file not asked about before, at once.
    pub fn row_group_copies_checked(&self, files: &[usize]) -> Result<Vec<bool>> {
        let said = |i: usize| self.row_group_checked.get(i).and_then(|c| c.get().copied());
        let (mut reads, mut asked) = (Vec::new(), Vec::new());
        for i in files.iter().copied().filter(|&i| said(i).is_none()) {
            let (meta, table) = self.parquet_file(i)?;
            // The first column chunk that has rows: its first page (a dictionary's, or data).
            match (0..table.num_row_groups()).find_map(|rg| table.chunk_range(rg, 0)) {
                Some(r) => {
                    reads.push((s3_object(meta)?, r.start..r.end.min(r.start + CRC_PROBE_BYTES)));
                    asked.push((i, r.end - r.start));
                }
                None => self.note_row_group_checked(i, false),
            }
        }
        if !reads.is_empty() {
            let store = self.backends.s3()?;
            let started = std::time::Instant::now();
            // Each error names its object, as a fetch's does.
            let got = store.block_on(store.get_each(&reads))?;
            let (mut with_crcs, mut no_md5) = (0, 0);
            for (&(i, chunk_len), (bytes, may_be_md5)) in asked.iter().zip(&got) {
                let crc = header_has_crc(bytes, chunk_len);
                if crc.is_none() {
                    let url = self.shards.get(i).map(|m| m.url()).unwrap_or_default();
                    tracing::warn!(shard = %url, "its first page header does not say whether its pages carry checksums; taken as none");
                }
                with_crcs += usize::from(crc == Some(true));
                no_md5 += usize::from(!may_be_md5);
                self.note_row_group_checked(i, crc == Some(true) || !may_be_md5);
            }
            tracing::info!(
                dataset = %self.url,
                files = asked.len(),
                with_page_checksums = with_crcs,
                etag_no_md5 = no_md5,
                ms = started.elapsed().as_millis() as u64,
                "read files' first page headers: how their row groups' copies are checked"
            );
        }
        Ok(files.iter().map(|&i| said(i).unwrap_or(false)).collect())
    }

    fn note_row_group_checked(&self, i: usize, checked: bool) {
        if let Some(c) = self.row_group_checked.get(i) {
            // Another stream may have read it meanwhile: the same file, the same answer.
            let _ = c.set(checked);
        }
    }
}
