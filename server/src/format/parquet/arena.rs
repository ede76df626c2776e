//! A decoded row group's binary values in a sealed shared-memory segment (an "arena"), for
//! streams that deliver binary columns as Arrow views (`StreamRequest.arrow_binary_views`).
//!
//! A shuffled batch draws its rows from many row groups. Copying each row's bytes into the batch
//! was most of a warm epoch of large rows (images): 77% of the daemon's samples were `memmove`,
//! and with the trainer on the other core the copy bounded the epoch (bench/PARQUET_PROFILE.md).
//! Arrow's view types let a column point into several data buffers: the batch then carries 16
//! bytes a row, and each row's bytes stay where the row group was decoded. For a client in
//! another process to read them there, a row group's bytes must live in memory it can map: this
//! module copies them once, when the row group is decoded, into a memfd, and rebuilds the row
//! group's `BinaryView` columns over that segment. Every later batch drawing on the row group
//! (this stream's, and every other view stream's on the node) copies nothing.
//!
//! The segment is sealed (`SHRINK`, `GROW`, `FUTURE_WRITE`) once written: no one, the daemon
//! included, can change or resize it afterwards, so a client may map it and hand out arrays over
//! it for as long as it likes; the pages live while anyone maps them.
//!
//! A batch names an arena by its descriptor's slot in the stream's session; the session finds a
//! source's arena from its arrays ([`arena_of`]): the segment's address is looked up in a registry
//! of live arenas, which each arena leaves when dropped (its row group evicted and no batch being
//! built from it).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, BinaryViewArray, RecordBatch};
use arrow_buffer::{Buffer, ScalarBuffer};
use arrow_schema::DataType;
use rustix::fs::{MemfdFlags, SealFlags};

use super::ParquetError;

/// Values of up to this many bytes live inside their view (Arrow's view layout).
pub(super) const INLINE: u32 = 12;

/// A sealed memfd holding the non-inline values of a row group's binary columns.
pub struct Arena {
    file: std::fs::File,
    map: memmap2::Mmap,
    /// A name unique in the daemon: the session's key for the arena's slot.
    path: PathBuf,
    /// The mapping is of a node-cache copy of the dataset's own file (see `super::mapped`): its
    /// pages are the cache's, and a row group over it holds only the bytes its values name.
    borrowed: bool,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena").field("path", &self.path).field("len", &self.map.len()).finish()
    }
}

impl Arena {
    pub fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// The session's key for this arena (no file of that name exists).
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn addr(&self) -> usize {
        self.map.as_ptr() as usize
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        registry().lock().unwrap_or_else(|p| p.into_inner()).remove(&self.addr());
    }
}

// `Buffer::from_custom_allocation` asks its owner to be unwind safe: nothing in an arena changes
// after it is made (its mapping is read-only and sealed), so a panic cannot leave one half-updated.
impl std::panic::RefUnwindSafe for Arena {}

/// Live arenas by the address of their mapping.
fn registry() -> &'static Mutex<BTreeMap<usize, Weak<Arena>>> {
    static REG: std::sync::OnceLock<Mutex<BTreeMap<usize, Weak<Arena>>>> = std::sync::OnceLock::new();
    REG.get_or_init(Mutex::default)
}

/// The arena `array`'s values live in: the one its data buffer starts. None for an array not
/// made by [`into_arena`] or loaded from a kept file (`super::kept`), or whose arena is gone,
/// which its own buffer would prevent.
pub fn arena_of(array: &BinaryViewArray) -> Option<Arc<Arena>> {
    let buf = array.data_buffers().first()?;
    let addr = buf.as_ptr() as usize;
    registry().lock().unwrap_or_else(|p| p.into_inner()).get(&addr).and_then(Weak::upgrade)
}

/// The first array of `batch` that [`into_arena`] moved (at the top or inside a struct): every
/// one of a row group is over the same arena.
pub fn first_view_array(batch: &RecordBatch) -> Option<&BinaryViewArray> {
    let mut found = Vec::new();
    for c in batch.columns() {
        view_arrays(c, &mut found);
        if let Some(&first) = found.first() {
            return Some(first);
        }
    }
    None
}

/// Every `BinaryView` array in `a` (itself, or a struct's children, depth first): the binary
/// columns [`into_arena`] moves; strings stay as decoded.
fn view_arrays<'a>(a: &'a ArrayRef, out: &mut Vec<&'a BinaryViewArray>) {
    match a.data_type() {
        DataType::BinaryView => out.extend(a.as_binary_view_opt()),
        DataType::Struct(_) => {
            if let Some(s) = a.as_struct_opt() {
                for c in s.columns() {
                    view_arrays(c, out);
                }
            }
        }
        _ => {}
    }
}

/// `a` with each `BinaryView` array in it (in [`view_arrays`] order) replaced by the next of
/// `rebuilt`.
fn replace_views(a: &ArrayRef, rebuilt: &mut impl Iterator<Item = ArrayRef>) -> Result<ArrayRef, ParquetError> {
    match a.data_type() {
        DataType::BinaryView => rebuilt.next().ok_or_else(|| fail("rebuild", "a view column went missing")),
        DataType::Struct(fields) => {
            let Some(s) = a.as_struct_opt() else { return Ok(a.clone()) };
            let children = s.columns().iter().map(|c| replace_views(c, rebuilt)).collect::<Result<Vec<_>, _>>()?;
            let fields: arrow_schema::Fields = fields
                .iter()
                .zip(&children)
                .map(|(f, c)| f.as_ref().clone().with_data_type(c.data_type().clone()))
                .collect();
            let s = arrow_array::StructArray::try_new(fields, children, s.nulls().cloned())
                .map_err(|e| ParquetError::Ipc(format!("rebuilding a struct over its arena: {e}")))?;
            Ok(Arc::new(s))
        }
        _ => Ok(a.clone()),
    }
}

/// Refuses an arena of `total` bytes that a view's 32-bit offset could not address throughout
/// (the offsets below are shifted into a view's top 32 bits, and would wrap).
fn fits_views(total: u64) -> Result<(), ParquetError> {
    if total > u64::from(u32::MAX) {
        return Err(ParquetError::ViewsTooLarge { bytes: total });
    }
    Ok(())
}

fn fail(what: &str, e: impl std::fmt::Display) -> ParquetError {
    ParquetError::Io(format!("cannot {what} a shared-memory segment for decoded values: {e}"))
}

/// `batch` with its `BinaryView` columns' values (at the top, and inside structs) moved into one
/// new arena, and the arena; the batch as it is (and None) when it has no such column. Values of
/// up to 12 bytes stay inside their views. The arena holds at least one byte (a segment cannot be
/// empty).
pub fn into_arena(batch: RecordBatch, name: &str) -> Result<(RecordBatch, Option<Arc<Arena>>), ParquetError> {
    let arrays = all_view_arrays(&batch);
    if arrays.is_empty() {
        return Ok((batch, None));
    }
    let mut total = 0u64;
    for a in &arrays {
        for &v in a.views().iter() {
            let len = v as u32;
            if len > INLINE {
                total += u64::from(len);
            }
        }
    }
    fits_views(total)?;
    let fd: OwnedFd = rustix::fs::memfd_create(
        format!("shardstream-decoded-{}", std::process::id()),
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(|e| fail("create", e))?;
    let len = total.max(1);
    rustix::fs::ftruncate(&fd, len).map_err(|e| fail("size", e))?;
    let file = std::fs::File::from(fd);
    // SAFETY: a new memfd only this function knows of, sized above; nothing else maps it.
    let mut map = unsafe { memmap2::MmapOptions::new().map_mut(&file) }.map_err(|e| fail("map", e))?;
    let mut at = 0usize;
    let mut views: Vec<Vec<u128>> = Vec::with_capacity(arrays.len());
    for a in &arrays {
        let mut out = Vec::with_capacity(a.len());
        for (i, &v) in a.views().iter().enumerate() {
            let n = v as u32;
            if n <= INLINE {
                out.push(v);
                continue;
            }
            // Read through the array (it resolves the view's buffer); a null row keeps its
            // bytes too, which no reader looks at.
            let bytes = a.value(i);
            map[at..at + bytes.len()].copy_from_slice(bytes);
            // Keep length and prefix (the low 64 bits); buffer 0 (this arena), offset `at`.
            out.push((v & u128::from(u64::MAX)) | ((at as u128) << 96));
            at += bytes.len();
        }
        views.push(out);
    }
    let map = map.make_read_only().map_err(|e| fail("protect", e))?;
    let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL;
    rustix::fs::fcntl_add_seals(&file, seals).map_err(|e| fail("seal", e))?;
    let arena = Arena::register(file, map, name, false);
    let data = arena.buffer()?;
    let batch = with_views_over(&batch, &arrays, views, &data)?;
    Ok((batch, Some(arena)))
}

impl Arena {
    /// An arena of `file`'s whole read-only mapping `map`, registered for [`arena_of`]. The
    /// caller vouches that neither ever changes (a sealed memfd, or a node-cache file the daemon
    /// never rewrites or truncates). `borrowed`: `file` is a node-cache copy of a dataset file,
    /// not a segment of decoded values.
    pub(super) fn register(file: std::fs::File, map: memmap2::Mmap, name: &str, borrowed: bool) -> Arc<Arena> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = PathBuf::from(format!("/shardstream-decoded/{}/{name}", NEXT.fetch_add(1, Ordering::Relaxed)));
        let arena = Arc::new(Arena { file, map, path, borrowed });
        registry().lock().unwrap_or_else(|p| p.into_inner()).insert(arena.addr(), Arc::downgrade(&arena));
        arena
    }

    /// The whole mapping as one Arrow buffer that keeps the arena alive.
    pub(super) fn buffer(self: &Arc<Self>) -> Result<Buffer, ParquetError> {
        let ptr = NonNull::new(self.map.as_ptr().cast_mut()).ok_or_else(|| fail("map", "null mapping"))?;
        // SAFETY: `ptr` .. `ptr + len` is the arena's mapping, which stays mapped and unchanged
        // (see `register`) while the buffer holds the arena (see `Arena`'s `RefUnwindSafe` note).
        Ok(unsafe { Buffer::from_custom_allocation(ptr, self.map.len(), self.clone()) })
    }

    /// The mapping's bytes.
    pub(super) fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// True when `addr` starts the mapping of a live arena over a node-cache copy of a dataset file
/// (`super::mapped`): a buffer there is the cache's pages, not memory a decode allocated.
pub fn is_borrowed(addr: usize) -> bool {
    let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    reg.get(&addr).and_then(Weak::upgrade).is_some_and(|a| a.borrowed)
}

/// `batch` with `arrays` (its [`view_arrays`], in order) rebuilt from `views`, each over the one
/// data buffer `data`.
pub(super) fn with_views_over(
    batch: &RecordBatch,
    arrays: &[&BinaryViewArray],
    views: Vec<Vec<u128>>,
    data: &Buffer,
) -> Result<RecordBatch, ParquetError> {
    let rebuilt = arrays
        .iter()
        .zip(views)
        .map(|(a, v)| {
            BinaryViewArray::try_new(ScalarBuffer::from(v), vec![data.clone()], a.nulls().cloned())
                .map(|r| Arc::new(r) as ArrayRef)
                .map_err(|e| ParquetError::Ipc(format!("rebuilding a column over its arena: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut rebuilt = rebuilt.into_iter();
    let columns = batch.columns().iter().map(|c| replace_views(c, &mut rebuilt)).collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(batch.schema(), columns)
        .map_err(|e| ParquetError::Ipc(format!("rebuilding a row group over its arena: {e}")))
}

/// Every `BinaryView` array of `batch` (at the top and inside structs), in column order.
pub(super) fn all_view_arrays(batch: &RecordBatch) -> Vec<&BinaryViewArray> {
    let mut arrays = Vec::new();
    for c in batch.columns() {
        view_arrays(c, &mut arrays);
    }
    arrays
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Int64Array, StringViewArray};
    use arrow_schema::{Field, Schema};

    #[test]
    fn an_arena_views_could_not_address_is_refused_by_size() {
        // An offset past 4 GiB shifted into a view's top 32 bits would wrap to another value's.
        assert!(fits_views(u64::from(u32::MAX)).is_ok());
        let e = fits_views(1 << 32).unwrap_err();
        assert!(matches!(e, ParquetError::ViewsTooLarge { bytes } if bytes == 1 << 32), "{e}");
        assert!(e.to_string().contains("without binary_views"), "{e}");
    }

    fn batch(values: &[Option<&[u8]>]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("image", DataType::BinaryView, true),
            Field::new("label", DataType::Int64, false),
            Field::new("caption", DataType::Utf8View, false),
        ]));
        let n = values.len();
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(BinaryViewArray::from_iter(values.iter().copied())),
                Arc::new(Int64Array::from_iter_values(0..n as i64)),
                Arc::new(StringViewArray::from_iter_values(
                    (0..n).map(|i| format!("a caption longer than twelve {i}")),
                )),
            ],
        )
        .unwrap()
    }

    #[test]
    fn values_move_into_a_sealed_segment_and_read_the_same() {
        let long: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        let values: Vec<Option<&[u8]>> = vec![Some(&long), Some(b"short"), None, Some(&long[7..4000]), Some(b"")];
        let before = batch(&values);
        let (after, arena) = into_arena(before.clone(), "t").unwrap();
        let arena = arena.expect("a binary column gets an arena");
        // Only the values longer than 12 bytes: 5000 + 3993.
        assert_eq!(arena.len(), 5000 + 3993);
        assert_eq!(after, before, "the same values, nulls and other columns");
        let col = after.column(0).as_binary_view();
        assert_eq!(col.data_buffers().len(), 1);
        assert!(Arc::ptr_eq(&arena_of(col).unwrap(), &arena));
        // Strings are not moved: their buffers are the decoder's.
        assert!(
            after
                .column(2)
                .as_string_view()
                .data_buffers()
                .iter()
                .all(|b| b.as_ptr() != col.data_buffers()[0].as_ptr())
        );
        let seals = rustix::fs::fcntl_get_seals(arena.file()).unwrap();
        assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL));
        // A writable mapping of the sealed segment is refused.
        // SAFETY: the call is expected to fail; had it mapped, the mapping would be dropped unused.
        assert!(unsafe { memmap2::MmapOptions::new().map_mut(arena.file()) }.is_err());
    }

    #[test]
    fn a_struct_s_binary_child_moves_too() {
        // A Hugging Face image: {bytes, path}, null as a whole in row 1, its bytes null in row 2.
        let bytes: Arc<dyn Array> =
            Arc::new(BinaryViewArray::from_iter([Some(vec![1u8; 300]), Some(vec![2u8; 40]), None, Some(vec![4u8; 3])]));
        let path: Arc<dyn Array> =
            Arc::new(StringViewArray::from_iter_values(["a/0.jpg", "a/1.jpg", "a/2.jpg", "a/3.jpg"]));
        let fields: arrow_schema::Fields =
            vec![Field::new("bytes", DataType::BinaryView, true), Field::new("path", DataType::Utf8View, false)].into();
        let nulls = arrow_buffer::NullBuffer::from(vec![true, false, true, true]);
        let image = arrow_array::StructArray::new(fields.clone(), vec![bytes, path], Some(nulls));
        let schema = Arc::new(Schema::new(vec![Field::new("image", DataType::Struct(fields), true)]));
        let before = RecordBatch::try_new(schema, vec![Arc::new(image)]).unwrap();
        let (after, arena) = into_arena(before.clone(), "t").unwrap();
        let arena = arena.expect("a struct's binary child gets an arena");
        assert_eq!(arena.len(), 300 + 40);
        assert_eq!(after, before);
        let child = first_view_array(&after).expect("the struct's bytes");
        assert!(Arc::ptr_eq(&arena_of(child).unwrap(), &arena));
    }

    #[test]
    fn an_arena_leaves_the_registry_when_its_last_holder_goes() {
        let long = vec![7u8; 100];
        let (after, arena) = into_arena(batch(&[Some(&long)]), "t").unwrap();
        let arena = arena.unwrap();
        let col = after.column(0).as_binary_view().clone();
        drop(arena);
        drop(after);
        // The column's buffer still holds it.
        assert!(arena_of(&col).is_some());
        let copy = BinaryViewArray::from_iter([Some(&long[..])]);
        assert!(arena_of(&copy).is_none(), "an array not made here has no arena");
        drop(col);
        assert_eq!(copy.value(0), &long[..]);
    }

    #[test]
    fn a_batch_without_binary_columns_is_left_alone() {
        let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
        let b = RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(vec![1, 2]))]).unwrap();
        let (same, arena) = into_arena(b.clone(), "t").unwrap();
        assert!(arena.is_none());
        assert_eq!(same, b);
    }

    #[test]
    fn only_inline_values_still_make_a_one_byte_segment() {
        let (after, arena) = into_arena(batch(&[Some(b"tiny"), None]), "t").unwrap();
        assert_eq!(arena.unwrap().len(), 1);
        assert_eq!(after.column(0).as_binary_view().value(0), b"tiny");
    }
}
