//! The Thrift compact protocol as Parquet's footer and page headers use it: a walk of a footer
//! or page header before arrow-rs reads it ([`check_struct`]), and a reader of the few fields the
//! daemon checks itself (`super::pages`).
//!
//! arrow-rs 60 is not safe to hand hostile Thrift, in two ways this walk closes:
//! - It skips a list, set or map of booleans (in a field it does not know) one element at a time
//!   without reading the byte each element takes, so a 49-byte file whose footer declares 2^31 of
//!   them kept a thread busy for seconds (found by the `parquet_footer` fuzz target), and it goes
//!   on to read those bytes as fields. The walk refuses such a collection unless it is empty, and
//!   any collection that declares more elements than the bytes left (each takes at least one).
//! - It reads a field it knows by its id, as the type parquet.thrift gives it, whatever type the
//!   wire says: an i32 sent as a binary is read as one varint, and the binary's bytes as fields
//!   (the fuzz target's next find, a 1,548-byte footer). The walk reads the same fields by id with
//!   the same types ([`super::idl`]) and refuses a field whose wire type is not that type, so
//!   every byte arrow-rs reads is one the walk read the same way, in as many steps.

// Compact protocol type ids.
pub(super) const BOOL_TRUE: u8 = 1;
pub(super) const BOOL_FALSE: u8 = 2;
pub(super) const BYTE: u8 = 3;
pub(super) const I16: u8 = 4;
pub(super) const I32: u8 = 5;
pub(super) const I64: u8 = 6;
pub(super) const DOUBLE: u8 = 7;
pub(super) const BINARY: u8 = 8;
pub(super) const LIST: u8 = 9;
pub(super) const SET: u8 = 10;
pub(super) const MAP: u8 = 11;
pub(super) const STRUCT: u8 = 12;
pub(super) const UUID: u8 = 13;

/// How deep a footer's structs and containers may nest (arrow-rs's own skip limit).
const FOOTER_DEPTH: u32 = 64;

/// Walks the `FileMetaData` at the start of `footer` to its end: the error says what is wrong
/// and where.
pub(super) fn check_struct(footer: &[u8]) -> Result<(), String> {
    Reader::new(footer, FOOTER_DEPTH, "footer").walk(super::idl::FILE_META_DATA, 0)
}

/// A value's type as parquet.thrift declares it and arrow-rs reads it (enums are i32, strings
/// binary, unions structs).
#[derive(Clone, Copy, Debug)]
pub(super) enum Ty {
    Bool,
    Byte,
    I16,
    I32,
    I64,
    Double,
    Binary,
    List(&'static Ty),
    /// Its fields by id: those arrow-rs reads; others are skipped by their wire type.
    Struct(&'static [(i16, Ty)]),
}

impl Ty {
    /// Whether a field of wire type `wire` (an element's, in a collection) holds this type.
    fn is(self, wire: u8) -> bool {
        matches!(
            (self, wire),
            (Ty::Bool, BOOL_TRUE | BOOL_FALSE)
                | (Ty::Byte, BYTE)
                | (Ty::I16, I16)
                | (Ty::I32, I32)
                | (Ty::I64, I64)
                | (Ty::Double, DOUBLE)
                | (Ty::Binary, BINARY)
                | (Ty::List(_), LIST)
                | (Ty::Struct(_), STRUCT)
        )
    }

    fn name(self) -> &'static str {
        match self {
            Ty::Bool => "a bool",
            Ty::Byte => "a byte",
            Ty::I16 => "an i16",
            Ty::I32 => "an i32",
            Ty::I64 => "an i64",
            Ty::Double => "a double",
            Ty::Binary => "a binary",
            Ty::List(_) => "a list",
            Ty::Struct(_) => "a struct",
        }
    }
}

/// What wire type `ty` is, for errors.
fn wire_name(ty: u8) -> &'static str {
    match ty {
        BOOL_TRUE | BOOL_FALSE => "a bool",
        BYTE => "a byte",
        I16 => "an i16",
        I32 => "an i32",
        I64 => "an i64",
        DOUBLE => "a double",
        BINARY => "a binary",
        LIST => "a list",
        SET => "a set",
        MAP => "a map",
        STRUCT => "a struct",
        UUID => "a uuid",
        _ => "of an unknown type",
    }
}

pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// How deep structs and containers may nest.
    max_depth: u32,
    /// What is read, for errors ("header", "footer").
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8], max_depth: u32, what: &'static str) -> Self {
        Self { buf, pos: 0, max_depth, what }
    }

    /// Bytes read so far.
    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    fn ends_inside(&self) -> String {
        format!("ends inside the {}", self.what)
    }

    pub(super) fn byte(&mut self) -> Result<u8, String> {
        let b = *self.buf.get(self.pos).ok_or_else(|| self.ends_inside())?;
        self.pos += 1;
        Ok(b)
    }

    pub(super) fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("a varint longer than 64 bits".into())
    }

    pub(super) fn zigzag(&mut self) -> Result<i64, String> {
        let v = self.varint()?;
        Ok((v >> 1) as i64 ^ -((v & 1) as i64))
    }

    pub(super) fn i32(&mut self) -> Result<i32, String> {
        let v = self.zigzag()?;
        i32::try_from(v).map_err(|_| format!("{v} does not fit an i32"))
    }

    fn advance(&mut self, n: u64) -> Result<(), String> {
        let end = usize::try_from(n).ok().and_then(|n| self.pos.checked_add(n)).filter(|&e| e <= self.buf.len());
        self.pos = end.ok_or_else(|| self.ends_inside())?;
        Ok(())
    }

    /// The fields of a struct, up to its stop byte: `f(reader, field id, type)` reads or skips each.
    pub(super) fn fields(
        &mut self,
        depth: u32,
        mut f: impl FnMut(&mut Self, i16, u8) -> Result<(), String>,
    ) -> Result<(), String> {
        if depth > self.max_depth {
            return Err("structs nested too deep".into());
        }
        let mut last = 0i16;
        loop {
            let b = self.byte()?;
            if b == 0 {
                return Ok(());
            }
            let (delta, ty) = (b >> 4, b & 0x0f);
            let id = if delta == 0 {
                i16::try_from(self.zigzag()?).map_err(|_| "a field id out of range".to_string())?
            } else {
                last.checked_add(i16::from(delta)).ok_or("a field id out of range")?
            };
            last = id;
            f(self, id, ty)?;
        }
    }

    /// Walks a struct whose fields are `fields`: one of them must have its type, any other is
    /// skipped.
    pub(super) fn walk(&mut self, fields: &'static [(i16, Ty)], depth: u32) -> Result<(), String> {
        self.fields(depth, |r, id, wire| match field(fields, id) {
            Some(ty) if !ty.is(wire) => {
                Err(format!("field {id} is {} where parquet.thrift has {}", wire_name(wire), ty.name()))
            }
            Some(ty) => r.typed(id, ty, depth),
            None => r.skip(wire, depth),
        })
    }

    /// A value of field `id`, of type `ty` (its wire type checked).
    fn typed(&mut self, id: i16, ty: Ty, depth: u32) -> Result<(), String> {
        match ty {
            Ty::Bool => Ok(()),
            Ty::Byte => self.advance(1),
            Ty::I16 | Ty::I32 | Ty::I64 => self.varint().map(drop),
            Ty::Double => self.advance(8),
            Ty::Binary => {
                let n = self.varint()?;
                self.advance(n)
            }
            Ty::List(elem) => {
                let (kind, n) = self.collection()?;
                if n > 0 && !elem.is(kind) {
                    return Err(format!(
                        "field {id} is a list of {} where parquet.thrift has a list of {}",
                        wire_name(kind),
                        elem.name()
                    ));
                }
                (0..n).try_for_each(|_| match *elem {
                    Ty::Bool => self.advance(1),
                    Ty::Struct(fields) => self.walk(fields, depth + 1),
                    other => self.typed(id, other, depth + 1),
                })
            }
            Ty::Struct(fields) => self.walk(fields, depth + 1),
        }
    }

    /// A list's or set's header: its elements' type and count, the count checked against the
    /// bytes left.
    fn collection(&mut self) -> Result<(u8, u64), String> {
        let b = self.byte()?;
        let n = match b >> 4 {
            15 => self.varint()?,
            n => u64::from(n),
        };
        self.elements(n, 1)?;
        Ok((b & 0x0f, n))
    }

    /// Field `want` (an i32) of a nested struct, skipping its other fields.
    pub(super) fn nested_i32(&mut self, want: i16) -> Result<Option<i32>, String> {
        let mut got = None;
        self.fields(1, |r, id, ty| match (id, ty) {
            (id, I32) if id == want => {
                got = Some(r.i32()?);
                Ok(())
            }
            _ => r.skip(ty, 2),
        })?;
        Ok(got)
    }

    /// Skips a value of type `ty` (a field's: a boolean field's value is its type).
    pub(super) fn skip(&mut self, ty: u8, depth: u32) -> Result<(), String> {
        if depth > self.max_depth {
            return Err("values nested too deep".into());
        }
        match ty {
            BOOL_TRUE | BOOL_FALSE => Ok(()),
            BYTE => self.advance(1),
            I16 | I32 | I64 => self.varint().map(drop),
            DOUBLE => self.advance(8),
            BINARY => {
                let n = self.varint()?;
                self.advance(n)
            }
            UUID => self.advance(16),
            LIST | SET => {
                let (kind, n) = self.collection()?;
                if n > 0 {
                    skippable(kind)?;
                }
                (0..n).try_for_each(|_| self.skip(kind, depth + 1))
            }
            MAP => {
                let n = self.varint()?;
                if n == 0 {
                    return Ok(());
                }
                let kv = self.byte()?;
                self.elements(n, 2)?;
                skippable(kv >> 4)?;
                skippable(kv & 0x0f)?;
                (0..n).try_for_each(|_| {
                    self.skip(kv >> 4, depth + 1)?;
                    self.skip(kv & 0x0f, depth + 1)
                })
            }
            STRUCT => self.fields(depth + 1, |r, _, ty| r.skip(ty, depth + 1)),
            other => Err(format!("unknown field type {other}")),
        }
    }

    /// Refuses `n` elements of at least `bytes` bytes each where fewer bytes are left.
    fn elements(&self, n: u64, bytes: u64) -> Result<(), String> {
        let left = self.buf.len() - self.pos;
        if n.saturating_mul(bytes) > left as u64 {
            return Err(format!("a collection declares {n} elements in the {left} bytes left of the {}", self.what));
        }
        Ok(())
    }
}

/// The type of field `id` in `fields`. Most tables list ids 1, 2, 3... in order, so the id's own
/// slot is tried first: a footer has a dozen fields per column chunk, a million chunks at most.
fn field(fields: &[(i16, Ty)], id: i16) -> Option<Ty> {
    let slot = usize::try_from(id).ok().and_then(|i| i.checked_sub(1)).and_then(|i| fields.get(i));
    match slot {
        Some(&(f, ty)) if f == id => Some(ty),
        _ => fields.iter().find(|(f, _)| *f == id).map(|&(_, ty)| ty),
    }
}

/// Refuses the elements of a collection arrow-rs cannot skip: booleans, which take a byte each
/// in a collection and which arrow-rs skips as if they took none, as in a field.
fn skippable(kind: u8) -> Result<(), String> {
    match kind {
        BOOL_TRUE | BOOL_FALSE => {
            Err("a collection of booleans in a field arrow-rs skips (it skips them without reading their bytes)".into())
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn footers_as_writers_make_them_pass() {
        use super::super::testdata::{Codec, mixed, wide};
        for bytes in [mixed(100, 30, Codec::Snappy), wide(10, 5, 40)] {
            let len = bytes.len();
            let footer_len = u32::from_le_bytes(bytes[len - 8..len - 4].try_into().unwrap()) as usize;
            check_struct(&bytes[len - 8 - footer_len..len - 8]).unwrap();
        }
    }

    #[test]
    fn what_no_writer_makes_is_refused_in_a_step_a_byte() {
        // Field 15 (unknown), a list (type 9) of 2^31-1 booleans, in 7 bytes.
        let e = check_struct(&[0xf9, 0xf1, 0xff, 0xff, 0xff, 0xff, 0x07]).unwrap_err();
        assert!(e.contains("declares 2147483647 elements"), "{e}");
        // An unknown field (15): a list of three booleans takes three bytes, which arrow-rs
        // does not read when it skips them, so it would read them as fields; the same as a map's
        // keys or values; an empty list of them is nothing to misread.
        assert!(check_struct(&[0xf9, 0x31, 1, 1, 2, 0]).unwrap_err().contains("booleans"));
        assert!(check_struct(&[0xfb, 0x02, 0x15, 1, 0, 1, 0, 0]).unwrap_err().contains("booleans"));
        check_struct(&[0xf9, 0x01, 0]).unwrap();
        check_struct(&[0xfb, 0x02, 0x55, 2, 4, 6, 8, 0]).unwrap();
        // A map of 5 pairs in 4 bytes; a binary longer than what is left.
        assert!(check_struct(&[0xfb, 0x05, 0x55, 1, 2, 3, 4]).unwrap_err().contains("declares 5"));
        assert!(check_struct(&[0xf8, 0x10, 1, 2]).unwrap_err().contains("ends inside the footer"));
        // Fields arrow-rs reads by id must have parquet.thrift's type: `version` (1) as a
        // binary, a list of schema elements (2) as a list of i32, a row group's columns given
        // as a binary inside a list of row groups.
        assert!(
            check_struct(&[0x18, 0x07, 0xf9, 0xf1, 0xff, 0xff, 0xff, 0xff, 0x07, 0]).unwrap_err().contains("field 1 ")
        );
        assert!(check_struct(&[0x29, 0x15, 2, 4, 0]).unwrap_err().contains("field 2 "));
        assert!(check_struct(&[0x49, 0x1c, 0x18, 0x00, 0x00, 0x00]).unwrap_err().contains("field 1 "));
        let deep: Vec<u8> = std::iter::once(0xfc).chain(std::iter::repeat_n(0x1c, 100)).collect();
        assert!(check_struct(&deep).unwrap_err().contains("too deep"));
        assert!(check_struct(&[0xfe]).unwrap_err().contains("unknown field type 14"));
    }
}
