//! The selected column chunks of a file (or of some of its row groups) as one compact byte
//! string: what the node cache holds of an S3 Parquet file when a stream selects only some of
//! its columns.
//!
//! The chunks of every row group are collected ([`chunk_ranges`]), sorted and merged when at most
//! [`MERGE_GAP`] apart (a small gap costs less than another request), and laid end to end: piece
//! `k` of the file (`range`) sits at `at` in the compact copy. A read of file bytes (what the
//! row-group decoder asks for: one merged run of a row group's chunks) maps to the copy when it
//! lies inside one piece; anything else is an error, never a silent fetch.
//!
//! A copy may also be the whole file ([`ProjectedFile::whole`]): one piece, every byte where the
//! file has it, so that the MD5 its ETag may hold checks it as a whole download is checked.

use std::ops::Range;

use super::ParquetTable;
#[cfg(test)]
use super::decode::{MERGE_GAP, chunk_ranges};
use super::decode::{leaf_chunks, merge_ranges};
use super::pages;
use super::schema::FileProjection;

/// The pieces of a file a projection needs, and where each sits in the compact copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProjectedFile {
    /// (file range, offset in the copy), sorted by file offset, disjoint.
    pieces: Vec<(Range<u64>, u64)>,
    /// The file range of every column chunk in the copy, one each (what [`Self::check_pages`]
    /// walks).
    chunks: Vec<Range<u64>>,
    len: u64,
    /// The copy is the whole file ([`Self::whole`]).
    whole: bool,
}

impl ProjectedFile {
    /// The pieces of `table`'s file that `proj` reads, over every row group.
    pub fn new(table: &ParquetTable, proj: &FileProjection) -> Self {
        Self::of_row_groups(table, proj, 0..table.num_row_groups())
    }

    /// The pieces of `table`'s file that `proj` reads in row groups `rgs` only: the copy of one
    /// row group, when a node cache too small for whole files' copies holds row groups.
    pub fn of_row_groups(table: &ParquetTable, proj: &FileProjection, rgs: Range<usize>) -> Self {
        let chunks: Vec<Range<u64>> = rgs.flat_map(|rg| leaf_chunks(table, rg, proj)).collect();
        let merged = merge_ranges(chunks.clone());
        let mut at = 0u64;
        let pieces = merged
            .into_iter()
            .map(|r| {
                let here = at;
                at += r.end - r.start;
                (r, here)
            })
            .collect();
        Self { pieces, chunks, len: at, whole: false }
    }

    /// The whole of `table`'s file as one piece, its bytes at their own offsets (a copy an MD5
    /// can check), with every column chunk to check by its pages when no MD5 can.
    pub fn whole(table: &ParquetTable) -> Self {
        let leaves = table.reader_metadata().parquet_schema().num_columns();
        let chunks = (0..table.num_row_groups())
            .flat_map(|rg| (0..leaves).filter_map(move |c| table.chunk_range(rg, c)))
            .filter(|r| !r.is_empty())
            .collect();
        let len = table.file_len();
        Self { pieces: vec![(0..len, 0)], chunks, len, whole: true }
    }

    /// True when the copy is the whole file, byte for byte ([`Self::whole`]).
    pub fn is_whole(&self) -> bool {
        self.whole
    }

    /// Checks the page checksums of every column chunk in the copy ([`pages::check_crcs_with`]:
    /// the pages that carry one), reading with `read(offset in the copy, buf)`. The pages
    /// without one; the reason when one does not match, naming the chunk.
    pub fn check_pages(&self, mut read: impl FnMut(u64, &mut [u8]) -> Result<(), String>) -> Result<u64, String> {
        let mut unchecked = 0;
        for chunk in &self.chunks {
            let at = self.locate(chunk.clone()).ok_or_else(|| format!("chunk {chunk:?} is not in the copy"))?;
            unchecked += pages::check_crcs_with(chunk.end - chunk.start, chunk.start, |from, buf| read(at + from, buf))
                .map_err(|e| format!("column chunk at byte {}: {e}", chunk.start))?;
        }
        Ok(unchecked)
    }

    /// Bytes of the compact copy.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// (file range, offset in the copy) of every piece, in file order.
    pub fn pieces(&self) -> &[(Range<u64>, u64)] {
        &self.pieces
    }

    /// Where file bytes `r` sit in the copy, when one piece holds them all.
    pub fn locate(&self, r: Range<u64>) -> Option<u64> {
        let i = self.pieces.partition_point(|(p, _)| p.start <= r.start).checked_sub(1)?;
        let (p, at) = &self.pieces[i];
        (r.end <= p.end && r.start <= r.end).then(|| at + (r.start - p.start))
    }
}

#[cfg(test)]
mod tests {
    use super::super::schema::Projection;
    use super::super::testdata;
    use super::*;

    use super::super::footer::table_of as table;

    #[test]
    fn one_column_is_a_small_copy_that_every_row_group_read_maps_into() {
        let file = testdata::mixed(4000, 500, testdata::Codec::None);
        let t = table(&file);
        let p = Projection::new(t.schema(), &[], Some(&["id".to_string()])).unwrap().for_file(&t, &[]).unwrap();
        let pf = ProjectedFile::new(&t, &p);
        assert!(!pf.is_empty() && pf.len() * 10 < file.len() as u64, "{} of {}", pf.len(), file.len());
        for rg in 0..t.num_row_groups() {
            for r in chunk_ranges(&t, rg, &p) {
                let at = pf.locate(r.clone()).expect("every read the decoder makes is in the copy");
                assert!(at + (r.end - r.start) <= pf.len());
            }
        }
        // Pieces are disjoint, in order, end to end in the copy.
        let mut next = 0;
        for w in pf.pieces().windows(2) {
            assert!(w[0].0.end + MERGE_GAP < w[1].0.start);
        }
        for (r, at) in pf.pieces() {
            assert_eq!(*at, next);
            next += r.end - r.start;
        }
        assert_eq!(next, pf.len());
        // A read of another column's bytes is not in it.
        let all = Projection::new(t.schema(), &[], None).unwrap().for_file(&t, &[]).unwrap();
        let whole = ProjectedFile::new(&t, &all);
        assert!(whole.len() > pf.len());
        let outside = chunk_ranges(&t, 0, &all).into_iter().find(|r| pf.locate(r.clone()).is_none());
        assert!(outside.is_some());
    }

    #[test]
    fn a_row_group_s_copy_holds_its_own_chunks_and_no_other_s() {
        let file = testdata::mixed(4000, 500, testdata::Codec::None);
        let t = table(&file);
        let p = Projection::new(t.schema(), &[], Some(&["id".to_string(), "label".to_string()]))
            .unwrap()
            .for_file(&t, &[])
            .unwrap();
        let whole = ProjectedFile::new(&t, &p);
        assert!(t.num_row_groups() > 2);
        let mut sum = 0;
        for rg in 0..t.num_row_groups() {
            let one = ProjectedFile::of_row_groups(&t, &p, rg..rg + 1);
            sum += one.len();
            for r in chunk_ranges(&t, rg, &p) {
                let at = one.locate(r.clone()).expect("the row group's reads are in its copy");
                assert!(at + (r.end - r.start) <= one.len());
            }
            let other = (rg + 1) % t.num_row_groups();
            assert!(chunk_ranges(&t, other, &p).into_iter().all(|r| one.locate(r).is_none()));
        }
        // The same chunks, each once: only the gaps merged into the whole file's pieces differ.
        assert!(sum <= whole.len(), "{sum} {}", whole.len());
        assert_eq!(ProjectedFile::of_row_groups(&t, &p, 0..t.num_row_groups()), whole);
        assert!(!whole.is_whole());
    }

    #[test]
    fn a_whole_file_s_copy_holds_every_byte_where_the_file_has_it() {
        let file = testdata::mixed(4000, 500, testdata::Codec::None);
        let t = table(&file);
        let p = Projection::new(t.schema(), &[], Some(&["id".to_string()])).unwrap().for_file(&t, &[]).unwrap();
        let whole = ProjectedFile::whole(&t);
        assert!(whole.is_whole());
        assert_eq!(whole.len(), file.len() as u64);
        let len = file.len() as u64;
        // Any read at all, the footer's too, is at its own offset.
        for r in [0..4, len - 8..len, 100..200, 0..len] {
            assert_eq!(whole.locate(r.clone()), Some(r.start), "{r:?}");
        }
        // Its pages are those of every chunk, checked where the file has them: a read outside
        // the file would fail the check.
        let mut read = Vec::new();
        whole
            .check_pages(|at, buf| {
                let bytes = file.get(at as usize..at as usize + buf.len()).ok_or("outside the file")?;
                buf.copy_from_slice(bytes);
                read.push(at);
                Ok(())
            })
            .unwrap();
        let first = chunk_ranges(&t, 0, &p).first().unwrap().start;
        assert!(read.contains(&first), "the first chunk's first page header is read at its offset");
        let all = Projection::new(t.schema(), &[], None).unwrap().for_file(&t, &[]).unwrap();
        let last = leaf_chunks(&t, t.num_row_groups() - 1, &all).last().unwrap();
        assert!(read.iter().any(|&at| last.contains(&at)), "the last column's last chunk is checked too");
    }
}
