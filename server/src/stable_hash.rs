//! The one stable hash of the daemon: FNV-1a, 64 bit.
//!
//! Everything hashed here ends up on disk or in a user's hands and must come out the same on
//! every machine, build and release: dataset fingerprints (saved in trainers' `state_dict`s),
//! node cache keys and index sidecar names (file names in the cache directory), pack journal
//! fingerprints and pack state directory names. `std`'s hashers are seeded per process and may
//! change algorithm between releases, so none of them may be used for such values. FNV-1a is
//! not collision resistant against an adversary; none of these values defends against one (a
//! sidecar also carries the shard's identity, and a cache entry its length and checksum).
//!
//! The golden tests below pin each persisted value for fixed inputs: a change that alters any of
//! them invalidates users' caches or saved states and must be deliberate.

/// FNV-1a 64-bit offset basis.
pub const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
pub const PRIME: u64 = 0x0000_0100_0000_01b3;

/// An FNV-1a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self::new()
    }
}

impl Fnv1a {
    pub const fn new() -> Self {
        Self(OFFSET)
    }

    /// A state started from another basis (a second, independent hash of the same input).
    pub const fn with_basis(basis: u64) -> Self {
        Self(basis)
    }

    /// Hashes `bytes`, as plain FNV-1a (no framing: ("ab", "c") and ("a", "bc") collide; see
    /// [`field`](Self::field)).
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(PRIME);
        }
        self
    }

    /// Hashes `bytes` followed by a separator (one extra multiply, which no byte value produces),
    /// so a sequence of fields hashes differently from any other split of the same bytes.
    pub fn field(&mut self, bytes: &[u8]) -> &mut Self {
        self.bytes(bytes);
        self.0 = self.0.wrapping_mul(PRIME);
        self
    }

    /// Rotates the state: a cheap way to make a second hash order-sensitive in another way.
    pub fn rotate(&mut self, bits: u32) -> &mut Self {
        self.0 = self.0.rotate_left(bits);
        self
    }

    pub const fn finish(&self) -> u64 {
        self.0
    }
}

/// Plain FNV-1a of `bytes`.
pub fn hash(bytes: &[u8]) -> u64 {
    Fnv1a::new().bytes(bytes).finish()
}

/// FNV-1a of `parts` as a sequence of fields ([`Fnv1a::field`]): ("ab", "c") and ("a", "bc")
/// differ, as names in a list must.
pub fn hash_fields<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = Fnv1a::new();
    for p in parts {
        h.field(p);
    }
    h.finish()
}

/// Plain FNV-1a of the concatenation of `parts`.
pub fn hash_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    let mut h = Fnv1a::new();
    for p in parts {
        h.bytes(p);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_fnv1a_vectors() {
        // From the FNV reference test suite (http://www.isthe.com/chongo/tech/comp/fnv/).
        assert_eq!(hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(hash_parts([&b"foo"[..], b"bar"]), hash(b"foobar"));
    }

    #[test]
    fn lists_of_names_are_framed_and_pinned() {
        // Projection ids: they name decoded row groups and the node cache's column-chunk copies.
        let a_bc = hash_fields([&b"a"[..], b"bc"]);
        assert_ne!(a_bc, hash_fields([&b"ab"[..], b"c"]));
        assert_eq!(a_bc, Fnv1a::new().field(b"a").field(b"bc").finish());
        assert_eq!(a_bc, 0x4018_01fc_84f3_ca79);
    }

    #[test]
    fn fields_are_framed() {
        let ab_c = Fnv1a::new().field(b"ab").field(b"c").finish();
        let a_bc = Fnv1a::new().field(b"a").field(b"bc").finish();
        assert_ne!(ab_c, a_bc);
    }
}
