//! A walk over a Parquet footer's Thrift (the compact protocol) before arrow-rs decodes it,
//! refusing a container that declares more elements than the bytes left could hold. Every
//! element of a list, set or map takes at least one byte (a boolean element too: unlike a boolean
//! field, whose value rides in its header), so no footer a writer made fails this; but arrow-rs
//! 60 skips a list of booleans in a field it does not know one element at a time without reading
//! those bytes, and a 49-byte file declaring 2^31 of them kept a thread busy for seconds. The walk
//! is linear in the footer's bytes: each step reads at least one.

/// How deep structs and containers may nest (arrow-rs's own skip limit).
const MAX_DEPTH: usize = 64;

/// Compact-protocol types.
const BOOL_TRUE: u8 = 1;
const BOOL_FALSE: u8 = 2;
const BYTE: u8 = 3;
const I16: u8 = 4;
const I32: u8 = 5;
const I64: u8 = 6;
const DOUBLE: u8 = 7;
const BINARY: u8 = 8;
const LIST: u8 = 9;
const SET: u8 = 10;
const MAP: u8 = 11;
const STRUCT: u8 = 12;
const UUID: u8 = 13;

/// Checks the struct at the start of `buf` (a footer's `FileMetaData`); the error says what is
/// wrong and where.
pub fn check(buf: &[u8]) -> Result<(), String> {
    let mut w = Walk { buf, at: 0 };
    w.structure(0)
}

struct Walk<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Walk<'_> {
    fn left(&self) -> usize {
        self.buf.len() - self.at
    }

    fn byte(&mut self) -> Result<u8, String> {
        let b = *self.buf.get(self.at).ok_or_else(|| format!("ends inside a value at byte {}", self.at))?;
        self.at += 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(format!("a varint longer than 10 bytes at byte {}", self.at))
    }

    fn skip(&mut self, n: u64) -> Result<(), String> {
        match usize::try_from(n).ok().filter(|&n| n <= self.left()) {
            Some(n) => {
                self.at += n;
                Ok(())
            }
            None => Err(format!("a value of {n} bytes at byte {} with {} left", self.at, self.left())),
        }
    }

    fn structure(&mut self, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err(format!("nests deeper than {MAX_DEPTH} at byte {}", self.at));
        }
        loop {
            let header = self.byte()?;
            if header == 0 {
                return Ok(());
            }
            if header >> 4 == 0 {
                self.varint()?; // the field id, when not given as a delta
            }
            match header & 0x0f {
                BOOL_TRUE | BOOL_FALSE => {} // a boolean field's value is its header's type
                t => self.value(t, depth + 1)?,
            }
        }
    }

    /// A value of type `t` (in a container, a boolean takes a byte).
    fn value(&mut self, t: u8, depth: usize) -> Result<(), String> {
        match t {
            BOOL_TRUE | BOOL_FALSE | BYTE => self.skip(1),
            I16 | I32 | I64 => self.varint().map(|_| ()),
            DOUBLE => self.skip(8),
            BINARY => {
                let n = self.varint()?;
                self.skip(n)
            }
            LIST | SET => {
                let header = self.byte()?;
                let n = match header >> 4 {
                    15 => self.varint()?,
                    n => u64::from(n),
                };
                self.elements(n, 1, depth)?;
                (0..n).try_for_each(|_| self.value(header & 0x0f, depth + 1))
            }
            MAP => {
                let n = self.varint()?;
                if n == 0 {
                    return Ok(());
                }
                let kinds = self.byte()?;
                self.elements(n, 2, depth)?;
                (0..n).try_for_each(|_| {
                    self.value(kinds >> 4, depth + 1)?;
                    self.value(kinds & 0x0f, depth + 1)
                })
            }
            STRUCT => self.structure(depth),
            UUID => self.skip(16),
            t => Err(format!("an unknown type {t} at byte {}", self.at)),
        }
    }

    /// Refuses `n` elements of at least `bytes` bytes each where fewer bytes are left.
    fn elements(&self, n: u64, bytes: u64, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err(format!("nests deeper than {MAX_DEPTH} at byte {}", self.at));
        }
        if n.saturating_mul(bytes) > self.left() as u64 {
            return Err(format!("a container at byte {} declares {n} elements in {} bytes", self.at, self.left()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn footers_as_writers_make_them_pass() {
        for bytes in [
            super::super::testdata::mixed(100, 30, super::super::testdata::Codec::Snappy),
            super::super::testdata::wide(10, 5, 40),
        ] {
            let len = bytes.len();
            let footer_len = u32::from_le_bytes(bytes[len - 8..len - 4].try_into().unwrap()) as usize;
            check(&bytes[len - 8 - footer_len..len - 8]).unwrap();
        }
    }

    #[test]
    fn containers_larger_than_their_bytes_are_refused() {
        // A struct with field 1, a list (delta 1, type 9) of 2^31-1 booleans.
        let mut list = vec![0x19, 0xf1];
        list.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x07]);
        let e = check(&list).unwrap_err();
        assert!(e.contains("declares 2147483647 elements"), "{e}");
        // A list of three booleans takes three bytes.
        check(&[0x19, 0x31, 1, 1, 2, 0]).unwrap();
        assert!(check(&[0x19, 0x31, 1, 1]).is_err());
        // A map of 5 pairs of bytes in 4 bytes; a binary longer than what is left.
        assert!(check(&[0x1b, 0x05, 0x33, 1, 2, 3, 4]).unwrap_err().contains("declares 5"));
        assert!(check(&[0x18, 0x10, 1, 2]).unwrap_err().contains("a value of 16 bytes"));
        // Structs nested past the limit.
        let deep: Vec<u8> = std::iter::repeat_n(0x1c, 100).collect();
        assert!(check(&deep).unwrap_err().contains("deeper"));
        assert!(check(&[0x1e]).unwrap_err().contains("unknown type 14"));
    }
}
