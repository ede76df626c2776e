//! Writes into page-cache files in pieces of at most [`PIECE`] bytes.
//!
//! A `write` of several MiB lets the kernel back the file with large folios. On a VM whose guest
//! reports free memory to its host (virtio-balloon free page reporting, which works on 2 MiB
//! blocks), such a folio comes from a block the host took back, and every page of it faults on
//! the host again as it is written; smaller folios come from blocks already split, which the host
//! still backs. On this project's VM, 4-16 MiB writes cost 1.6-6.6 times (medians; up to 12
//! times in single rounds) the system time of the same bytes written 1 MiB at a time from the
//! same buffer, and smaller pieces gained nothing more (`bench/write_sizes.py`, bench/PARQUET_PROFILE.md "Writes of a MiB"). On a machine
//! without that cost a syscall per MiB is noise, so the node cache's large writes go through
//! here.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;

/// The most bytes one `write` hands the kernel.
pub const PIECE: usize = 1 << 20;

/// A writer that passes each `write` on cut to at most [`PIECE`] bytes (`write_all` loops).
#[derive(Debug)]
pub struct Pieces<W>(pub W);

impl<W: Write> Write for Pieces<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(&buf[..buf.len().min(PIECE)])
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

/// `file.write_all_at(buf, pos)`, a [`PIECE`] at a time.
pub fn write_all_at(file: &File, buf: &[u8], pos: u64) -> std::io::Result<()> {
    let mut at = pos;
    for piece in buf.chunks(PIECE) {
        file.write_all_at(piece, at)?;
        at += piece.len() as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the size of every `write` it is given.
    #[derive(Default)]
    struct Sizes {
        bytes: Vec<u8>,
        calls: Vec<usize>,
    }

    impl Write for Sizes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.calls.push(buf.len());
            self.bytes.extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_large_write_reaches_the_writer_in_pieces_in_order() {
        let buf: Vec<u8> = (0..(3 * PIECE + 12_345)).map(|i| (i % 253) as u8).collect();
        let mut w = Pieces(Sizes::default());
        w.write_all(&buf).unwrap();
        assert_eq!(w.0.calls, vec![PIECE, PIECE, PIECE, 12_345]);
        assert_eq!(w.0.bytes, buf);
    }

    #[test]
    fn positioned_pieces_land_where_one_write_would() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = File::options().read(true).write(true).create_new(true).open(&path).unwrap();
        let buf: Vec<u8> = (0..(2 * PIECE + 7)).map(|i| (i % 241) as u8).collect();
        write_all_at(&file, &buf, 10).unwrap();
        let back = std::fs::read(&path).unwrap();
        assert_eq!(back.len(), 10 + buf.len());
        assert_eq!(&back[..10], &[0u8; 10]);
        assert_eq!(&back[10..], &buf[..]);
    }
}
