//! The buffers a batch's sample reads append to ([`Append`]): a growing `Vec` (the body of an
//! inline message) or a fixed region that cannot grow ([`Fixed`]: an rdma staging buffer,
//! registered with libfabric, which a batch is gathered straight into instead of being copied
//! there afterwards).

use crate::{Error, Result};

/// A byte buffer that samples are appended to, and compacted in place.
pub trait Append {
    /// The bytes appended so far.
    fn filled(&self) -> &[u8];

    fn filled_mut(&mut self) -> &mut [u8];

    /// Room for `len` more bytes past [`Self::filled`]: a pointer to them, which may be
    /// uninitialised. An error when a fixed buffer has less room than that.
    fn spare(&mut self, len: usize) -> Result<*mut u8>;

    /// Counts `len` bytes past the end as filled.
    ///
    /// # Safety
    /// The caller wrote all `len` bytes through the pointer [`Self::spare`] returned for at least
    /// `len` bytes, with no other call in between.
    unsafe fn grow(&mut self, len: usize);

    /// Keeps the first `len` bytes (no-op when there are fewer).
    fn truncate(&mut self, len: usize);

    fn len(&self) -> usize {
        self.filled().len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Append for Vec<u8> {
    fn filled(&self) -> &[u8] {
        self
    }

    fn filled_mut(&mut self) -> &mut [u8] {
        self
    }

    fn spare(&mut self, len: usize) -> Result<*mut u8> {
        self.reserve(len);
        Ok(self.spare_capacity_mut().as_mut_ptr().cast())
    }

    unsafe fn grow(&mut self, len: usize) {
        // SAFETY: per the contract, `spare(len)` reserved these bytes and the caller wrote them.
        unsafe { self.set_len(Vec::len(self) + len) };
    }

    fn truncate(&mut self, len: usize) {
        Vec::truncate(self, len);
    }
}

/// A fixed region filled from its start; appending past its end is an error, never a reallocation.
pub struct Fixed<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl<'a> Fixed<'a> {
    pub fn new(buf: &'a mut [u8]) -> Self {
        Self { buf, len: 0 }
    }

    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    fn room(&self, len: usize) -> Result<()> {
        if len > self.buf.len() - self.len {
            return Err(Error::invalid(format!(
                "{len} more bytes do not fit: {} of the buffer's {} bytes are filled",
                self.len,
                self.buf.len()
            )));
        }
        Ok(())
    }
}

impl Append for Fixed<'_> {
    fn filled(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    fn filled_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }

    fn spare(&mut self, len: usize) -> Result<*mut u8> {
        self.room(len)?;
        Ok(self.buf[self.len..].as_mut_ptr())
    }

    unsafe fn grow(&mut self, len: usize) {
        // Checked by `spare` already; kept so the length can never pass the region.
        self.len = (self.len + len).min(self.buf.len());
    }

    fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Appends `bytes` the way a positioned read does: through `spare`, then `grow`.
    fn append(buf: &mut (impl Append + ?Sized), bytes: &[u8]) -> Result<()> {
        let p = buf.spare(bytes.len())?;
        // SAFETY: `spare` gave room for `bytes.len()` bytes at `p`, which cannot overlap `bytes`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
            buf.grow(bytes.len());
        }
        Ok(())
    }

    /// Both buffers hold the same bytes after the same appends and compaction.
    #[test]
    fn a_fixed_region_fills_like_a_vec() {
        let mut region = [0u8; 32];
        let mut fixed = Fixed::new(&mut region);
        let mut vec = Vec::new();
        for b in [&mut fixed as &mut dyn Append, &mut vec] {
            append(b, b"hello, world").unwrap();
            b.filled_mut().copy_within(7..12, 0);
            b.truncate(5);
            append(b, b"!").unwrap();
        }
        assert_eq!(fixed.filled(), b"world!");
        assert_eq!(fixed.filled(), vec.filled());
    }

    #[test]
    fn a_fixed_region_refuses_what_does_not_fit_and_keeps_its_bytes() {
        let mut region = [0u8; 8];
        let mut fixed = Fixed::new(&mut region);
        append(&mut fixed, b"abcdef").unwrap();
        let err = append(&mut fixed, b"xyz").expect_err("9 bytes in 8");
        assert!(err.to_string().contains("3 more bytes do not fit: 6 of the buffer's 8 bytes"), "{err}");
        append(&mut fixed, b"gh").unwrap();
        assert_eq!(fixed.filled(), b"abcdefgh");
        assert_eq!(fixed.capacity(), 8);
    }
}
