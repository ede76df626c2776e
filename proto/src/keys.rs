//! A packed batch's keys, in either of the forms `PackedBatch` carries them: one string each
//! (`keys`), or one UTF-8 run and each key's end in it (`key_bytes`, `key_ends`), which a client
//! asks for with `StreamRequest.packed_keys_joined`.

use crate::v1::PackedBatch;

/// Why the joined keys of a batch cannot be read: a daemon bug, never input a client can fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeysError {
    #[error("key {index} ends at byte {end}, before the key before it or past the {len} key bytes")]
    Bounds { index: usize, end: u32, len: usize },
    #[error("key {index} is not UTF-8")]
    Utf8 { index: usize },
    #[error("the batch carries both key forms ({strings} strings and {joined} joined keys)")]
    Both { strings: usize, joined: usize },
}

impl PackedBatch {
    /// Samples in the batch (its keys, in either form).
    pub fn key_count(&self) -> usize {
        self.keys.len().max(self.key_ends.len())
    }

    /// The keys in sample order, checked (each within the bytes, after the one before, UTF-8).
    pub fn key_strs(&self) -> Result<Vec<&str>, KeysError> {
        if self.key_ends.is_empty() {
            return Ok(self.keys.iter().map(String::as_str).collect());
        }
        if !self.keys.is_empty() {
            return Err(KeysError::Both { strings: self.keys.len(), joined: self.key_ends.len() });
        }
        let all: &[u8] = &self.key_bytes;
        let mut start = 0usize;
        let mut out = Vec::with_capacity(self.key_ends.len());
        for (index, &end) in self.key_ends.iter().enumerate() {
            let bounds = KeysError::Bounds { index, end, len: all.len() };
            let stop = usize::try_from(end).map_err(|_| bounds.clone())?;
            let bytes = all.get(start..stop).ok_or(bounds)?;
            out.push(std::str::from_utf8(bytes).map_err(|_| KeysError::Utf8 { index })?);
            start = stop;
        }
        Ok(out)
    }
}

/// Builds the joined form: the daemon's side of [`PackedBatch::key_strs`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct JoinedKeys {
    pub bytes: Vec<u8>,
    pub ends: Vec<u32>,
}

impl JoinedKeys {
    /// Room for `keys` keys of about `key_len` bytes each, up to [`Self::MOST_RESERVED`] bytes
    /// of them (more grows as keys come): the first key of a batch guesses the others' length,
    /// and a first key of a megabyte (a PAX path) times a large batch asked for tens of GB.
    pub fn with_capacity(keys: usize, key_len: usize) -> Self {
        let bytes = keys.saturating_mul(key_len).min(Self::MOST_RESERVED);
        Self { bytes: Vec::with_capacity(bytes), ends: Vec::with_capacity(keys) }
    }

    /// The most key bytes [`Self::with_capacity`] reserves.
    pub const MOST_RESERVED: usize = 16 << 20;

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Appends a key; None once the batch's keys pass 4 GiB (no batch comes near).
    pub fn push(&mut self, key: &str) -> Option<()> {
        self.bytes.extend_from_slice(key.as_bytes());
        self.ends.push(u32::try_from(self.bytes.len()).ok()?);
        Some(())
    }

    /// The keys, a string each (for a client that reads `PackedBatch.keys`).
    pub fn to_strings(&self) -> Vec<String> {
        let mut start = 0usize;
        self.ends
            .iter()
            .map(|&end| {
                let end = end as usize;
                let key = String::from_utf8_lossy(self.bytes.get(start..end).unwrap_or_default()).into_owned();
                start = end;
                key
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_first_key_reserves_a_bounded_guess() {
        // A 1 MiB first key (a PAX path) and a batch of 32 Ki samples: 32 GiB guessed before.
        let keys = JoinedKeys::with_capacity(32 << 10, 1 << 20);
        assert!(keys.bytes.capacity() <= JoinedKeys::MOST_RESERVED);
        assert_eq!(JoinedKeys::with_capacity(256, 20).bytes.capacity(), 5120);
    }

    fn batch(keys: &JoinedKeys) -> PackedBatch {
        PackedBatch { key_bytes: keys.bytes.clone().into(), key_ends: keys.ends.clone(), ..Default::default() }
    }

    #[test]
    fn joined_keys_read_back_in_order_and_as_strings() {
        let mut a = JoinedKeys::with_capacity(2, 4);
        for k in ["s0/a", "", "ключ", "x", "yz"] {
            a.push(k).unwrap();
        }
        let want = ["s0/a", "", "ключ", "x", "yz"];
        assert_eq!(batch(&a).key_strs().unwrap(), want);
        assert_eq!(batch(&a).key_count(), 5);
        assert_eq!(a.to_strings(), want);
        let strings = PackedBatch { keys: want.map(String::from).to_vec(), ..Default::default() };
        assert_eq!(strings.key_strs().unwrap(), want);
        assert_eq!(strings.key_count(), 5);
    }

    #[test]
    fn malformed_joined_keys_are_refused_naming_the_key() {
        let mut ok = JoinedKeys::default();
        ok.push("ab").unwrap();
        ok.push("cd").unwrap();
        let mut past = batch(&ok);
        past.key_ends[1] = 9;
        assert_eq!(past.key_strs(), Err(KeysError::Bounds { index: 1, end: 9, len: 4 }));
        let mut backwards = batch(&ok);
        backwards.key_ends = vec![3, 1];
        assert!(matches!(backwards.key_strs(), Err(KeysError::Bounds { index: 1, .. })));
        let mut bad = batch(&ok);
        bad.key_bytes = vec![b'a', b'b', 0xff, b'd'].into();
        assert_eq!(bad.key_strs(), Err(KeysError::Utf8 { index: 1 }));
        let mut both = batch(&ok);
        both.keys = vec!["ab".into()];
        assert!(matches!(both.key_strs(), Err(KeysError::Both { strings: 1, joined: 2 })));
    }
}
