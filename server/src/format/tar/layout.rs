//! Where each sample's key and fields lie within its byte range, recorded while a shard is
//! indexed, so that neither the daemon (inline and packed batches) nor a shared-memory client
//! parses TAR headers per delivered sample.
//!
//! Per sample: the key's (offset, length) and each shard field's (offset, length), offsets
//! relative to the sample's first byte, as `u32`. Cost: `4 x (2 + 2 x fields)` bytes per sample
//! (a shard of `cls` + `jpg`: 24 bytes, on top of the 8 of its boundary). A shard where some
//! location cannot be recorded this way (a sample over 4 GiB, a key split over a ustar `prefix`,
//! a name that is not UTF-8) gets no layout, and its samples are parsed as before.

use std::ops::Range;

/// The most layout words per location it records (a key or a member): a shard whose samples
/// share their fields takes 2, one whose samples each have one of a hundred optional fields
/// about 100; one sample of a thousand fields then samples of one, about a thousand.
const MAX_SLOTS_PER_LOCATION: usize = 256;

/// Offset of a field the sample does not have.
pub const MISSING: u32 = u32::MAX;

/// Per-sample key and field locations of one shard (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    fields: usize,
    words: Vec<u32>,
}

impl Layout {
    /// Words per sample for a shard of `fields` fields.
    pub fn stride(fields: usize) -> usize {
        2 + 2 * fields
    }

    /// A layout from its words (`samples * stride(fields)` of them), None when the count is wrong.
    pub fn from_words(fields: usize, samples: usize, words: Vec<u32>) -> Option<Self> {
        (Some(words.len()) == samples.checked_mul(Self::stride(fields))).then_some(Self { fields, words })
    }

    pub fn words(&self) -> &[u32] {
        &self.words
    }

    fn sample(&self, i: usize) -> Option<&[u32]> {
        let stride = Self::stride(self.fields);
        self.words.get(i.checked_mul(stride)?..i.checked_mul(stride)?.checked_add(stride)?)
    }

    /// Starts loading sample `i`'s words into the cache (see [`crate::cache_hint`]).
    pub fn prefetch(&self, i: usize) {
        if let Some(w) = i.checked_mul(Self::stride(self.fields)).and_then(|at| self.words.get(at)) {
            crate::cache_hint::prefetch(w);
        }
    }

    /// The key of sample `i`: its byte range relative to the sample's start.
    pub fn key(&self, i: usize) -> Option<Range<usize>> {
        let w = self.sample(i)?;
        range(w[0], w[1])
    }

    /// Field `f` (index into the shard's sorted fields) of sample `i`: Some(None) when the sample
    /// lacks it; None when `i` or `f` is out of range.
    pub fn field(&self, i: usize, f: usize) -> Option<Option<Range<usize>>> {
        if f >= self.fields {
            return None;
        }
        let w = self.sample(i)?;
        let (off, len) = (w[2 + 2 * f], w[3 + 2 * f]);
        Some(if off == MISSING { None } else { Some(range(off, len)?) })
    }

    /// True when every recorded range lies within its sample (`boundaries` as in `TarIndex`):
    /// what a layout from elsewhere (a sidecar) must satisfy before it slices anything.
    pub fn fits(&self, boundaries: &[u64]) -> bool {
        let stride = Self::stride(self.fields);
        let samples = boundaries.len().saturating_sub(1);
        self.words.len() == samples * stride
            && self.words.chunks_exact(stride).zip(boundaries.windows(2)).all(|(w, b)| {
                let len = b[1].saturating_sub(b[0]);
                let within = |off: u32, n: u32| u64::from(off) + u64::from(n) <= len;
                within(w[0], w[1]) && w[2..].chunks_exact(2).all(|p| p[0] == MISSING || within(p[0], p[1]))
            })
    }

    pub fn heap_bytes(&self) -> usize {
        self.words.capacity() * size_of::<u32>()
    }
}

fn range(off: u32, len: u32) -> Option<Range<usize>> {
    let off = usize::try_from(off).ok()?;
    Some(off..off.checked_add(usize::try_from(len).ok()?)?)
}

/// Collects locations while a shard is scanned; gives up (no layout) at the first one that
/// cannot be recorded.
#[derive(Debug, Default)]
pub(super) struct LayoutBuilder {
    failed: bool,
    /// Per sample: key (offset, length).
    keys: Vec<(u32, u32)>,
    /// (sample, field in first-seen order, offset, length).
    members: Vec<(u32, u16, u32, u32)>,
    seen: Vec<String>,
}

impl LayoutBuilder {
    fn rel(start: u64, at: u64) -> Option<u32> {
        at.checked_sub(start).and_then(|d| u32::try_from(d).ok()).filter(|&d| d != MISSING)
    }

    /// A new sample starting at shard offset `start`, whose key lies at `key` (absolute), or
    /// None when the key is not a contiguous UTF-8 byte range of the shard.
    pub(super) fn sample(&mut self, start: u64, key: Option<Range<u64>>) {
        let key =
            key.and_then(|k| Some((Self::rel(start, k.start)?, u32::try_from(k.end.checked_sub(k.start)?).ok()?)));
        match key {
            Some(k) if !self.failed && u32::try_from(self.keys.len()).is_ok() => self.keys.push(k),
            _ => self.failed = true,
        }
    }

    /// A member of the current sample (started at `start`): field `field`, payload at `data`
    /// (absolute) of `size` bytes.
    pub(super) fn member(&mut self, start: u64, field: &str, data: u64, size: u64) {
        if self.failed {
            return;
        }
        let id = match self.seen.iter().position(|f| f == field) {
            Some(id) => id,
            None => {
                self.seen.push(field.to_owned());
                self.seen.len() - 1
            }
        };
        let (Some(off), Ok(len), Ok(id), Some(sample)) = (
            Self::rel(start, data),
            u32::try_from(size),
            u16::try_from(id),
            self.keys.len().checked_sub(1).and_then(|s| u32::try_from(s).ok()),
        ) else {
            self.failed = true;
            return;
        };
        self.members.push((sample, id, off, len));
    }

    /// The layout for the shard's sorted `fields` (every field seen is among them).
    pub(super) fn finish(self, fields: &[String]) -> Option<Layout> {
        // An empty shard has nothing to locate (and stores no layout).
        if self.failed || self.keys.is_empty() {
            return None;
        }
        let to_sorted: Vec<usize> = self.seen.iter().map(|f| fields.binary_search(f).ok()).collect::<Option<_>>()?;
        let stride = Layout::stride(fields.len());
        let len = self.keys.len().checked_mul(stride)?;
        // A slot per sample and field of the shard: where few samples have most of the fields
        // (one sample of a thousand, then samples of one) that is mostly empty slots, up to
        // thousands of times the members' count; such a shard is parsed per sample instead.
        if len > MAX_SLOTS_PER_LOCATION.saturating_mul(self.keys.len() + self.members.len()) {
            return None;
        }
        let mut words = vec![MISSING; len];
        for (i, (off, len)) in self.keys.iter().enumerate() {
            words[i * stride] = *off;
            words[i * stride + 1] = *len;
        }
        for &(sample, id, off, len) in &self.members {
            let at = sample as usize * stride + 2 + 2 * to_sorted[usize::from(id)];
            words[at] = off;
            words[at + 1] = len;
        }
        Some(Layout { fields: fields.len(), words })
    }
}
