//! Row groups decoded over the mapping of a node-cache copy of their file, so that values stored
//! uncompressed are served from where the file holds them, without a copy.
//!
//! A file the node cache holds (an `s3://` dataset's, or a local one read with `cache="copy"`)
//! never changes while it is used: it is published whole, pinned, and evicted by unlinking,
//! which leaves a mapping valid. Such a file is mapped once ([`MappedFile`]) and the row-group
//! decoder reads its column chunks from the mapping instead of reading them into new memory.
//! arrow-rs decodes the uncompressed pages of a binary or string column as views into the pages'
//! bytes (a PLAIN page's own, or those of the dictionary page a dictionary-encoded page indexes);
//! [`rebase`] then points the row group's `BinaryView` columns at the whole mapping as one
//! buffer, which makes the file itself the row group's arena (`super::arena`): a client maps it
//! as it maps any arena, and nothing is copied into a segment or kept on disk. That is the layout
//! `pack --format parquet` writes payloads in (uncompressed PLAIN, bench/PARQUET_LAYOUT.md). A
//! compressed page is decompressed into memory as before, and its row group is served the way it
//! was.
//!
//! Views hold 32-bit offsets: a mapping over 4 GiB cannot be one view buffer, so files that large
//! are decoded from their mapping but their values are moved into an arena as before.
//!
//! A file read in place (`cache="direct"`) is never mapped here: anyone may truncate it, and a
//! touched page past the new end would kill the daemon with SIGBUS.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use arrow_array::{Array, RecordBatch};
use bytes::Bytes;

use super::ParquetError;
use super::arena::{self, Arena, INLINE};
use super::decode::ChunkSet;
use super::projected::ProjectedFile;

/// Entries of [`live`] past which the dead ones are dropped (at the next new mapping).
const PRUNE_AT: usize = 4096;

/// The mappings of node-cache copies in use, by the copy's device and inode: a copy fetched again
/// after an eviction is another file, and gets a mapping of its own.
fn live() -> &'static Mutex<Live> {
    static LIVE: OnceLock<Mutex<Live>> = OnceLock::new();
    LIVE.get_or_init(Mutex::default)
}

type Live = HashMap<(u64, u64), Weak<Arena>>;

/// A node-cache copy of a dataset file, mapped read-only as an arena.
#[derive(Debug)]
pub struct MappedFile {
    arena: Arc<Arena>,
    /// The copy's device and inode.
    identity: (u64, u64),
    /// Where the file's bytes lie in the copy: None for a whole copy (offsets are the file's);
    /// the pieces for a compact copy of some column chunks.
    locate: Option<Arc<ProjectedFile>>,
    /// The dataset file's length (what the footer's offsets are within).
    file_len: u64,
}

/// A piece of the mapping as the bytes the decoder reads; it keeps the mapping alive.
struct Piece {
    arena: Arc<Arena>,
    range: Range<usize>,
}

impl AsRef<[u8]> for Piece {
    fn as_ref(&self) -> &[u8] {
        // In bounds: checked when the piece was made, and the mapping never changes length.
        self.arena.bytes().get(self.range.clone()).unwrap_or_default()
    }
}

impl MappedFile {
    /// Maps `copy`, the node-cache copy of the dataset file `name` (`file_len` bytes; `locate`:
    /// see the field). The caller vouches that `copy` is a published cache file: never written
    /// or truncated again.
    pub fn map(
        copy: std::fs::File,
        name: &str,
        file_len: u64,
        locate: Option<Arc<ProjectedFile>>,
    ) -> Result<Self, ParquetError> {
        use std::os::unix::fs::MetadataExt;
        let m =
            copy.metadata().map_err(|e| ParquetError::Io(format!("cannot stat the node-cache copy of {name}: {e}")))?;
        Self::map_identified(copy, (m.dev(), m.ino()), name, file_len, locate)
    }

    fn map_identified(
        copy: std::fs::File,
        identity: (u64, u64),
        name: &str,
        file_len: u64,
        locate: Option<Arc<ProjectedFile>>,
    ) -> Result<Self, ParquetError> {
        // SAFETY: a published node-cache file is immutable (filled under a temporary name and
        // renamed; evicted by unlink, never truncated or rewritten in place), so its pages stay
        // as mapped for as long as the mapping lives.
        let map = unsafe { memmap2::Mmap::map(&copy) }
            .map_err(|e| ParquetError::Io(format!("cannot map the node-cache copy of {name}: {e}")))?;
        let arena = Arena::register(copy, map, name, true);
        Ok(Self { arena, identity, locate, file_len })
    }

    /// `copy` (device and inode `identity`) mapped: the mapping a live row group of the same
    /// copy already uses, whichever stream made it, or a new one. Streams sharing a mapping share
    /// its arena, so a trainer's ranks and workers map each copy once, and the decoded row groups
    /// they share name one segment.
    pub fn shared(
        copy: std::fs::File,
        identity: (u64, u64),
        name: &str,
        file_len: u64,
        locate: Option<Arc<ProjectedFile>>,
    ) -> Result<Self, ParquetError> {
        let mut live = live().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(arena) = live.get(&identity).and_then(Weak::upgrade) {
            return Ok(Self { arena, identity, locate, file_len });
        }
        let m = Self::map_identified(copy, identity, name, file_len, locate)?;
        if live.len() >= PRUNE_AT {
            live.retain(|_, a| a.strong_count() > 0);
        }
        live.insert(identity, Arc::downgrade(&m.arena));
        Ok(m)
    }

    /// The copy's device and inode.
    pub fn identity(&self) -> (u64, u64) {
        self.identity
    }

    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// File ranges `ranges` (sorted, disjoint: `decode::chunk_ranges`) as a chunk set over the
    /// mapping: no byte is copied.
    pub fn chunks(&self, ranges: &[Range<u64>]) -> Result<ChunkSet, ParquetError> {
        let map_len = self.arena.len();
        let mut pieces = Vec::with_capacity(ranges.len());
        for r in ranges {
            if r.end > self.file_len || r.start > r.end {
                return Err(ParquetError::Truncated(format!("bytes {r:?} lie past its end ({})", self.file_len)));
            }
            let at = match &self.locate {
                None => r.start,
                Some(pf) => pf.locate(r.clone()).ok_or_else(|| {
                    ParquetError::Io(format!("bytes {r:?} are not in the node cache's copy of its column chunks"))
                })?,
            };
            let end = at + (r.end - r.start);
            if end > map_len {
                return Err(ParquetError::Truncated(format!(
                    "the node-cache copy holds {map_len} bytes, bytes {at}..{end} were asked for"
                )));
            }
            let range = usize::try_from(at)
                .and_then(|s| Ok(s..usize::try_from(end)?))
                .map_err(|_| ParquetError::Io(format!("bytes {r:?} lie beyond this machine's address space")))?;
            pieces.push((r.start, Bytes::from_owner(Piece { arena: self.arena.clone(), range })));
        }
        ChunkSet::from_pieces(self.file_len, pieces)
    }
}

/// `batch` (decoded from `arena`'s chunks) with every `BinaryView` column (at the top and inside
/// structs) over `arena`'s whole mapping as its one data buffer, when each of their values lies
/// in the mapping at an offset a view can hold; None when one does not (a compressed page's
/// values are in memory the decoder allocated), or when the batch has no such column.
pub fn rebase(batch: &RecordBatch, arena: &Arc<Arena>) -> Result<Option<RecordBatch>, ParquetError> {
    let arrays = arena::all_view_arrays(batch);
    if arrays.is_empty() {
        return Ok(None);
    }
    let base = arena.bytes().as_ptr() as usize;
    let end = base + arena.bytes().len();
    let mut views = Vec::with_capacity(arrays.len());
    for a in &arrays {
        // Each data buffer's offset in the mapping, or None when it lies elsewhere.
        let starts: Option<Vec<u64>> = a
            .data_buffers()
            .iter()
            .map(|b| {
                let p = b.as_ptr() as usize;
                (p >= base && p + b.len() <= end).then(|| (p - base) as u64)
            })
            .collect();
        let Some(starts) = starts else { return Ok(None) };
        let mut out = Vec::with_capacity(a.len());
        for &v in a.views().iter() {
            if (v as u32) <= INLINE {
                out.push(v);
                continue;
            }
            let (buffer, offset) = ((v >> 64) as u32 as usize, u64::from((v >> 96) as u32));
            let Some(at) = starts.get(buffer).map(|s| s + offset) else {
                return Err(ParquetError::Ipc(format!("a view names data buffer {buffer} of {}", starts.len())));
            };
            let Ok(at) = u32::try_from(at) else { return Ok(None) };
            // Keep length and prefix (the low 64 bits); buffer 0 (the mapping), offset `at`.
            out.push((v & u128::from(u64::MAX)) | (u128::from(at) << 96));
        }
        views.push(out);
    }
    let data = arena.buffer()?;
    arena::with_views_over(batch, &arrays, views, &data).map(Some)
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::super::decode::{chunk_ranges, decode_row_group, read_row_group};
    use super::super::schema::Projection;
    use super::super::testdata;
    use super::*;

    fn copy_of(bytes: &[u8]) -> std::fs::File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    use super::super::footer::table_of as table;

    fn read(bytes: &[u8]) -> impl FnMut(u64, usize) -> Result<Vec<u8>, ParquetError> + '_ {
        move |o, len| Ok(bytes[o as usize..o as usize + len].to_vec())
    }

    #[test]
    fn uncompressed_values_are_served_from_the_mapping_itself() {
        let bytes = testdata::mixed(300, 64, testdata::Codec::None);
        let t = table(&bytes);
        let fields = ["id", "label", "caption", "image", "blob", "text"].map(String::from).to_vec();
        let fp = Projection::new(t.schema(), &[], Some(&fields)).unwrap().for_file(&t, &[]).unwrap();
        let m = MappedFile::map(copy_of(&bytes), "f.parquet", bytes.len() as u64, None).unwrap();
        for rg in 0..t.num_row_groups() {
            let chunks = m.chunks(&chunk_ranges(&t, rg, &fp)).unwrap();
            let decoded = decode_row_group(&t, rg, &fp, chunks).unwrap();
            let rebased = rebase(&decoded, m.arena()).unwrap().expect("uncompressed pages: every value in the file");
            let (read, _) = read_row_group(&t, rg, &fp, read(&bytes)).unwrap();
            assert_eq!(rebased, read, "row group {rg}: the same rows as read into memory");
            let image = arena::first_view_array(&rebased).unwrap();
            assert!(Arc::ptr_eq(&arena::arena_of(image).unwrap(), m.arena()), "the file is the arena");
            assert!(arena::is_borrowed(image.data_buffers()[0].as_ptr() as usize));
            // Every long value is where the file holds it.
            for (i, &v) in image.views().iter().enumerate() {
                if (v as u32) > INLINE {
                    let at = (v >> 96) as usize;
                    assert_eq!(&bytes[at..at + v as u32 as usize], image.value(i));
                }
            }
        }
    }

    /// A copy of test data in `codec`, mapped, and row group `rg` of its `image` column decoded
    /// from the mapping; with the file's bytes, table and projection.
    fn image_from_copy(
        codec: testdata::Codec,
        rows: usize,
        rg_rows: usize,
        rg: usize,
    ) -> (Vec<u8>, MappedFile, RecordBatch, super::super::ParquetTable, super::super::schema::FileProjection) {
        let bytes = testdata::mixed(rows, rg_rows, codec);
        let t = table(&bytes);
        let fp = Projection::new(t.schema(), &[], Some(&["image".to_string()])).unwrap().for_file(&t, &[]).unwrap();
        let m = MappedFile::map(copy_of(&bytes), "f.parquet", bytes.len() as u64, None).unwrap();
        let chunks = m.chunks(&chunk_ranges(&t, rg, &fp)).unwrap();
        let decoded = decode_row_group(&t, rg, &fp, chunks).unwrap();
        (bytes, m, decoded, t, fp)
    }

    #[test]
    fn a_row_group_over_a_copy_holds_the_bytes_its_values_name() {
        let (bytes, m, decoded, _, _) = image_from_copy(testdata::Codec::None, 400, 100, 1);
        let over = rebase(&decoded, m.arena()).unwrap().unwrap();
        let image = arena::first_view_array(&over).unwrap();
        let named: u64 = image.views().iter().map(|&v| u64::from(v as u32)).filter(|&n| n > 12).sum();
        let nulls = image.nulls().map_or(0, |n| n.buffer().capacity() as u64);
        let held = super::super::decoded::held_bytes(&over);
        assert_eq!(held, named + 16 * image.len() as u64 + nulls, "not the whole file ({} bytes)", bytes.len());
        assert!(held < bytes.len() as u64 / 2);
    }

    #[test]
    fn values_past_what_a_view_can_address_are_left_as_decoded() {
        use arrow_array::BinaryViewArray;
        use arrow_buffer::{Buffer, ScalarBuffer};
        use arrow_schema::{DataType, Field, Schema};
        // A sparse copy of 5 GiB: values 4.5 GiB in cannot be named by a view's 32-bit offset.
        let f = tempfile::tempfile().unwrap();
        f.set_len(5 << 30).unwrap();
        let m = MappedFile::map(f, "big.parquet", 5 << 30, None).unwrap();
        let over = |at: u64| {
            let range = at..at + 100;
            let chunks = m.chunks(std::slice::from_ref(&range)).unwrap();
            let piece = chunks.pieces()[0].1.clone();
            // One 40-byte value at the start of the piece: buffer 0, offset 0.
            let view = 40u128;
            let values = BinaryViewArray::try_new(ScalarBuffer::from(vec![view]), vec![Buffer::from(piece)], None);
            let schema = Arc::new(Schema::new(vec![Field::new("image", DataType::BinaryView, false)]));
            RecordBatch::try_new(schema, vec![Arc::new(values.unwrap())]).unwrap()
        };
        let near = rebase(&over(1 << 30), m.arena()).unwrap().expect("1 GiB in: addressable");
        assert_eq!(arena::first_view_array(&near).unwrap().views()[0] >> 96, 1 << 30);
        assert!(rebase(&over(9 << 29), m.arena()).unwrap().is_none(), "4.5 GiB in: left as decoded");
    }

    #[test]
    fn streams_share_a_copy_s_mapping_while_it_is_used() {
        let bytes = testdata::mixed(50, 10, testdata::Codec::None);
        let path = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(path.path(), &bytes).unwrap();
        let open = || std::fs::File::open(path.path()).unwrap();
        // Identities no real file has here: the registry is the process's.
        let (id, other) = ((u64::MAX, 1), (u64::MAX, 2));
        let len = bytes.len() as u64;
        let a = MappedFile::shared(open(), id, "f", len, None).unwrap();
        let b = MappedFile::shared(open(), id, "f", len, None).unwrap();
        assert!(Arc::ptr_eq(a.arena(), b.arena()), "one mapping for both");
        let c = MappedFile::shared(open(), other, "f", len, None).unwrap();
        assert!(!Arc::ptr_eq(a.arena(), c.arena()), "a copy fetched again is another file");
        let first = Arc::downgrade(a.arena());
        drop((a, b));
        assert!(first.upgrade().is_none(), "the registry does not keep a mapping alive");
        let d = MappedFile::shared(open(), id, "f", len, None).unwrap();
        assert_eq!(d.arena().bytes(), &bytes[..]);
    }

    #[test]
    fn compressed_values_are_left_as_decoded() {
        let (bytes, m, decoded, t, fp) = image_from_copy(testdata::Codec::Snappy, 200, 64, 0);
        assert!(rebase(&decoded, m.arena()).unwrap().is_none(), "decompressed values are not in the file");
        let (read, _) = read_row_group(&t, 0, &fp, read(&bytes)).unwrap();
        assert_eq!(decoded, read, "decoded from the mapping all the same");
    }

    #[test]
    fn a_copy_shorter_than_the_footer_says_is_an_error_not_a_fault() {
        let bytes = testdata::mixed(200, 64, testdata::Codec::None);
        let t = table(&bytes);
        let fp = Projection::new(t.schema(), &[], None).unwrap().for_file(&t, &[]).unwrap();
        let m = MappedFile::map(copy_of(&bytes[..bytes.len() / 2]), "f.parquet", bytes.len() as u64, None).unwrap();
        let last = t.num_row_groups() - 1;
        let e = m.chunks(&chunk_ranges(&t, last, &fp)).unwrap_err();
        assert!(matches!(e, ParquetError::Truncated(_)), "{e}");
    }
}
