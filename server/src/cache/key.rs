//! Cache keys that carry their hash. A key names a copy by its source's hash and its file name
//! (~110 bytes for a row group's copy), and the prefetcher looks each future key up several
//! times a tick (its own maps, the cut, the cache table): hashing those bytes every time was half
//! of the prefetch thread's samples with 16,000 row-group copies (bench/S3_RESULTS.md, "Keys
//! hashed once"). A [`CacheKey`] is hashed once, when the dataset or the copy plan makes it; a
//! lookup by its [`KeyRef`] hashes eight bytes and compares the strings only on equal hashes.
//! The string is shared (an `Arc`) by the maps a key is copied into from a [`KeyRef`] that
//! carries it (the cache table's entry made by a fill, the prefetcher's map), so that even that
//! comparison is of two pointers: comparing the bytes of two copies, a cache miss each, was most
//! of what hashing once left.
//!
//! The hash is seeded at random once per process (the keys come from users' file names: a fixed
//! seed would let a dataset choose colliding names), so it is never stored or sent anywhere.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, OnceLock};

/// The hash every key is hashed with (one random seed for the process's life).
fn key_hash(key: &str) -> u64 {
    static STATE: OnceLock<foldhash::quality::RandomState> = OnceLock::new();
    STATE.get_or_init(Default::default).hash_one(key)
}

/// An owned cache key and its hash.
#[derive(Clone)]
pub struct CacheKey {
    hash: u64,
    key: Arc<str>,
}

impl CacheKey {
    pub fn new(key: impl Into<Arc<str>>) -> Self {
        let key = key.into();
        Self { hash: key_hash(&key), key }
    }

    pub fn as_str(&self) -> &str {
        &self.key
    }

    pub fn key_ref(&self) -> KeyRef<'_> {
        KeyRef { hash: self.hash, key: &self.key, shared: Some(&self.key) }
    }
}

/// Owns a borrowed key, keeping its hash, and its string when the borrow carries one.
impl From<KeyRef<'_>> for CacheKey {
    fn from(k: KeyRef<'_>) -> Self {
        Self { hash: k.hash, key: k.shared.map_or_else(|| k.key.into(), Arc::clone) }
    }
}

impl std::ops::Deref for CacheKey {
    type Target = str;
    fn deref(&self) -> &str {
        &self.key
    }
}

impl std::fmt::Debug for CacheKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.key.fmt(f)
    }
}

impl PartialEq for CacheKey {
    fn eq(&self, o: &Self) -> bool {
        self.key_ref() == o.key_ref()
    }
}

impl Eq for CacheKey {}

impl Hash for CacheKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl PartialOrd for CacheKey {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// By the string, so that an order of keys does not depend on the process's seed.
impl Ord for CacheKey {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.key.cmp(&o.key)
    }
}

/// A borrowed cache key and its hash: what the prefetcher's maps are keyed by, and what looks up
/// a [`CacheKey`] in a `hashbrown` map ([`hashbrown::Equivalent`]).
#[derive(Clone, Copy)]
pub struct KeyRef<'a> {
    hash: u64,
    key: &'a str,
    /// The owned key's string, when borrowed from a [`CacheKey`]: an owned copy made from this
    /// borrow shares it.
    shared: Option<&'a Arc<str>>,
}

impl<'a> KeyRef<'a> {
    pub fn as_str(&self) -> &'a str {
        self.key
    }
}

/// Hashes `key` (for a caller holding only the string: once per fill, not per walk).
impl<'a> From<&'a str> for KeyRef<'a> {
    fn from(key: &'a str) -> Self {
        Self { hash: key_hash(key), key, shared: None }
    }
}

impl<'a> From<&'a String> for KeyRef<'a> {
    fn from(key: &'a String) -> Self {
        key.as_str().into()
    }
}

impl<'a> From<&'a CacheKey> for KeyRef<'a> {
    fn from(key: &'a CacheKey) -> Self {
        key.key_ref()
    }
}

impl std::fmt::Debug for KeyRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.key.fmt(f)
    }
}

impl PartialEq for KeyRef<'_> {
    fn eq(&self, o: &Self) -> bool {
        // The same string (a key borrowed twice from one plan, or an entry made from its borrow)
        // needs no comparison.
        self.hash == o.hash && (std::ptr::eq(self.key, o.key) || self.key == o.key)
    }
}

impl Eq for KeyRef<'_> {}

impl Hash for KeyRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl hashbrown::Equivalent<CacheKey> for KeyRef<'_> {
    fn equivalent(&self, key: &CacheKey) -> bool {
        *self == key.key_ref()
    }
}

/// A map keyed by owned cache keys, looked up by [`KeyRef`] without hashing the string again.
pub type KeyMap<V> = hashbrown::HashMap<CacheKey, V, foldhash::fast::RandomState>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_found_by_its_string_and_by_its_ref_and_only_by_its_own() {
        let mut m: KeyMap<u32> = KeyMap::default();
        let a = CacheKey::new("0123456789abcdef-train-000001.parquet.rg17");
        m.insert(a.clone(), 1);
        m.insert(CacheKey::new("0123456789abcdef-train-000001.parquet.rg18"), 2);
        assert_eq!(m.get(&KeyRef::from("0123456789abcdef-train-000001.parquet.rg17")), Some(&1));
        assert_eq!(m.get(&a.key_ref()), Some(&1));
        assert_eq!(m.get(&KeyRef::from("0123456789abcdef-train-000001.parquet.rg19")), None);
        assert_eq!(KeyRef::from(&*a), a.key_ref(), "a key hashes alike whoever hashes it");
        // A forged equal hash is not an equal key: the strings decide.
        let forged = KeyRef { hash: a.hash, key: "other", shared: None };
        assert_ne!(forged, a.key_ref());
        assert_eq!(m.get(&forged), None);
    }

    #[test]
    fn an_owned_copy_of_a_borrowed_key_shares_its_string() {
        let a = CacheKey::new("k");
        let copy = CacheKey::from(a.key_ref());
        assert!(Arc::ptr_eq(&a.key, &copy.key), "made from a key's borrow: one string");
        let apart = CacheKey::from(KeyRef::from("k"));
        assert!(!Arc::ptr_eq(&a.key, &apart.key));
        assert_eq!(apart, a, "two strings alike are one key");
    }
}
