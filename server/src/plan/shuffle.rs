//! The plan's randomness and its two shuffles: the epoch's shard order (a full permutation of the
//! shards) and the shuffle buffer that mixes samples inside a rank's share.
//!
//! Everything random in the plan comes from [`Rng`], written out here rather than taken from a
//! crate: the sample order is part of the product's contract ("same seed -> same order on any
//! machine", and a resume state recorded under one build must replay under the next), so it must
//! not move when a dependency is upgraded or the code runs on another platform. The generator is
//!
//! - **SplitMix64** (Steele, Lea & Flood 2014) to turn (domain, seed, epoch, rank) into a seed
//!   ([`derive_seed`]) and to expand a 64-bit seed into the 256-bit state, as its authors advise;
//! - **xoshiro256\*\*** (Blackman & Vigna 2018) for the draws: 256-bit state, passes BigCrush,
//!   only shifts, rotations, xors and wrapping multiplications, so identical on every target;
//! - **Lemire's multiply-and-reject** ([`Rng::below`]) for unbiased integers in `0..n`, and
//!   Fisher-Yates on top of it ([`Rng::shuffle`]).
//!
//! The tests pin the published reference outputs of SplitMix64 and xoshiro256\*\*, so the
//! transcription is checked against the algorithms and not only against itself.

/// Increment of the SplitMix64 state: the odd integer closest to 2^64 / golden ratio, from the
/// algorithm's definition (any change here changes every seed).
const SPLITMIX64_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Domain of the shard-order generator, so that it never shares a stream with the window shuffle
/// even when seed, epoch and rank coincide ("shrdordr" in ASCII).
const SHARD_ORDER_DOMAIN: u64 = u64::from_be_bytes(*b"shrdordr");

/// Domain of the per-rank window shuffle ("rankwndw" in ASCII).
const WINDOW_DOMAIN: u64 = u64::from_be_bytes(*b"rankwndw");

/// One SplitMix64 step: advances `state` and returns a well-mixed 64-bit value. The output
/// function is a bijection of the state, so distinct inputs never collide.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(SPLITMIX64_GAMMA);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Mixes a domain tag and several words into one seed, order-sensitively: each word is folded in
/// through a SplitMix64 step, which is a bijection, so two parameter lists that differ only in
/// their last word (e.g. epoch 0 and epoch 1) always give different seeds.
pub fn derive_seed(domain: u64, parts: &[u64]) -> u64 {
    parts.iter().fold(mix(domain), |acc, &part| mix(acc ^ part))
}

/// SplitMix64's output for the state `x`, as a pure function (a bijection of `x`).
fn mix(x: u64) -> u64 {
    let mut state = x;
    splitmix64(&mut state)
}

/// xoshiro256\*\* seeded through SplitMix64; see the module docs for why it is hand-written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// Expands `seed` into the 256-bit state with four SplitMix64 steps (the seeding the
    /// algorithm's authors recommend). The state is never all zero: the four outputs come from
    /// four distinct SplitMix64 states through a bijection, so at most one of them is zero.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        Self { s: [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)] }
    }

    /// A generator from a raw state, for checking against the published reference vectors.
    #[cfg(test)]
    fn from_state(s: [u64; 4]) -> Self {
        Self { s }
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// A uniform integer in `0..n`, without modulo bias (Lemire, "Fast random integer generation
    /// in an interval", 2019): the high word of `x * n` is the candidate; the low word tells when
    /// `x` fell into the short last stripe, which is rejected. Returns 0 for `n == 0` rather than
    /// panicking (the plan never asks for it).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            // 2^64 mod n: the number of low words that would make some results more likely.
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }

    /// A uniform index in `0..len` (0 for an empty range).
    fn index(&mut self, len: usize) -> usize {
        // usize -> u64 is lossless on every supported target, and the result is below `len`.
        self.below(len as u64) as usize
    }

    /// Fisher-Yates (Durstenfeld) shuffle: every permutation equally likely.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.index(i + 1);
            items.swap(i, j);
        }
    }
}

/// The epoch's shard order: with `shuffle`, a uniformly random permutation of `0..num_shards`
/// drawn from a generator seeded by (seed, epoch), so every epoch has its own order and every rank
/// computes the same one; without, the identity. Shard indices are `u32`: a count above
/// `u32::MAX + 1` is truncated to it (the plan rejects such datasets before calling this).
pub fn shard_order(num_shards: usize, seed: u64, epoch: u64, shuffle: bool) -> Vec<u32> {
    let mut order: Vec<u32> = (0..=u32::MAX).take(num_shards).collect();
    if shuffle {
        Rng::new(derive_seed(SHARD_ORDER_DOMAIN, &[seed, epoch])).shuffle(&mut order);
    }
    order
}

/// The generator of rank `rank`'s window shuffle in (seed, epoch).
pub(crate) fn window_rng(seed: u64, epoch: u64, rank: u32) -> Rng {
    Rng::new(derive_seed(WINDOW_DOMAIN, &[seed, epoch, u64::from(rank)]))
}

/// The shuffle window in samples: `window_shards` average shards, `window_shards *
/// ceil(total_samples / num_shards)`, at least 1 (a window of one sample leaves the order as it
/// is, which is what `window_shards == 0` means). Saturates instead of overflowing: a window
/// larger than a rank's share is simply a full shuffle of the share.
pub fn window_samples(total_samples: u64, num_shards: usize, window_shards: u32) -> u64 {
    let per_shard = total_samples.div_ceil((num_shards as u64).max(1));
    per_shard.saturating_mul(u64::from(window_shards)).max(1)
}

/// Shuffles `items` inside a sliding window of `window` items (clamped to `1..=items.len()`),
/// with a hard bound on how far any item moves. The items are taken in chunks of half a window;
/// each output block is the previous chunk's leftovers plus a uniformly random part of the next
/// chunk, shuffled together. So every item leaves within two chunks of arriving: it moves by
/// less than `window` positions either way, and any `window` consecutive outputs draw on at most
/// three windows of input. (A plain shuffle buffer has a geometric tail of stragglers that keeps
/// old shards in use and makes the prefetcher's working set grow with `ln` of the shard size.)
pub fn window_shuffle<T: Copy>(items: &mut [T], window: u64, rng: &mut Rng) {
    let len = items.len();
    // Clamp in u64 first: the window may not fit in usize, the share does.
    let w = usize::try_from(window.clamp(1, len.max(1) as u64)).unwrap_or(len);
    if len < 2 || w < 2 {
        return;
    }
    if w >= len {
        // The window spans the whole share: a full uniform shuffle of it.
        rng.shuffle(items);
        return;
    }
    let chunk = w / 2;
    let mut out = Vec::with_capacity(len);
    let mut left: Vec<T> = Vec::new();
    for part in items.chunks(chunk) {
        let mut fresh = part.to_vec();
        rng.shuffle(&mut fresh);
        let defer = rng.index(fresh.len() + 1);
        let deferred = fresh.split_off(fresh.len() - defer);
        let mut block = std::mem::replace(&mut left, deferred);
        block.extend(fresh);
        rng.shuffle(&mut block);
        out.extend(block);
    }
    rng.shuffle(&mut left);
    out.extend(left);
    items.copy_from_slice(&out);
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    // Explicitly: proptest's prelude exports a trait of the same name.
    use super::Rng;

    #[test]
    fn splitmix64_matches_the_published_reference() {
        // Reference outputs of SplitMix64 (Vigna's splitmix64.c) from the states 0 and 1234567.
        let mut state = 0;
        let got: Vec<u64> = (0..4).map(|_| splitmix64(&mut state)).collect();
        assert_eq!(got, [0xE220_A839_7B1D_CDAF, 0x6E78_9E6A_A1B9_65F4, 0x06C4_5D18_8009_454F, 0xF88B_B8A8_724C_81EC]);
        let mut state = 1_234_567;
        let got: Vec<u64> = (0..5).map(|_| splitmix64(&mut state)).collect();
        assert_eq!(
            got,
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423,
                4_593_380_528_125_082_431,
                16_408_922_859_458_223_821
            ]
        );
    }

    #[test]
    fn xoshiro256starstar_matches_the_published_reference() {
        // Reference outputs of xoshiro256starstar.c from the state {1, 2, 3, 4}.
        let mut rng = Rng::from_state([1, 2, 3, 4]);
        let got: Vec<u64> = (0..10).map(|_| rng.next_u64()).collect();
        let want = [
            11_520,
            0,
            1_509_978_240,
            1_215_971_899_390_074_240,
            1_216_172_134_540_287_360,
            607_988_272_756_665_600,
            16_172_922_978_634_559_625,
            8_476_171_486_693_032_832,
            10_595_114_339_597_558_777,
            2_904_607_092_377_533_576,
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn golden_seeding_and_bounded_draws() {
        // Pins our own layers on top of the reference algorithms: seed derivation, seeding and
        // Lemire's reduction. A change here changes every user's sample order.
        assert_eq!(derive_seed(SHARD_ORDER_DOMAIN, &[0, 0]), GOLDEN_SHARD_SEED);
        let mut rng = Rng::new(42);
        let draws: Vec<u64> = (0..8).map(|_| rng.below(10)).collect();
        assert_eq!(draws, GOLDEN_BELOW_10);
        assert_eq!(shard_order(10, 0, 0, true), GOLDEN_SHARD_ORDER);
    }

    const GOLDEN_SHARD_SEED: u64 = 0x9CDE_0576_EF51_2BDC;
    const GOLDEN_BELOW_10: [u64; 8] = [0, 3, 6, 9, 9, 7, 7, 8];
    const GOLDEN_SHARD_ORDER: [u32; 10] = [1, 3, 5, 0, 2, 4, 7, 6, 9, 8];

    #[test]
    fn derive_seed_separates_domains_and_order() {
        assert_ne!(derive_seed(1, &[2, 3]), derive_seed(1, &[3, 2]));
        assert_ne!(derive_seed(1, &[2, 3]), derive_seed(2, &[2, 3]));
        assert_ne!(derive_seed(1, &[2]), derive_seed(1, &[2, 0]));
        assert_ne!(window_rng(0, 0, 0), window_rng(0, 0, 1));
    }

    #[test]
    fn below_is_in_range_and_uniform() {
        let mut rng = Rng::new(7);
        assert_eq!(rng.below(0), 0);
        assert_eq!(rng.below(1), 0);
        // A bound just above 2^63 rejects almost half the raw draws: the worst case for Lemire.
        let big = (1u64 << 63) + 1;
        assert!((0..1000).all(|_| rng.below(big) < big));
        const DRAWS: u32 = 60_000;
        let mut counts = [0u32; 6];
        for _ in 0..DRAWS {
            counts[rng.index(6)] += 1;
        }
        // Each count is Binomial(60000, 1/6): mean 10000, sd ~91; 1000 is 11 sd.
        assert!(counts.iter().all(|&c| (9_000..11_000).contains(&c)), "{counts:?}");
    }

    #[test]
    fn shuffle_reaches_every_permutation_evenly() {
        // 3 items, 6 permutations, 60000 shuffles: each permutation ~10000 times.
        let mut rng = Rng::new(11);
        let mut counts = std::collections::HashMap::new();
        for _ in 0..60_000 {
            let mut v = [0u8, 1, 2];
            rng.shuffle(&mut v);
            *counts.entry(v).or_insert(0u32) += 1;
        }
        assert_eq!(counts.len(), 6);
        assert!(counts.values().all(|&c| (9_000..11_000).contains(&c)), "{counts:?}");
    }

    #[test]
    fn shard_order_without_shuffle_is_the_identity() {
        assert_eq!(shard_order(5, 1, 2, false), [0, 1, 2, 3, 4]);
        assert!(shard_order(0, 1, 2, true).is_empty());
    }

    #[test]
    fn window_samples_rounds_up_and_never_is_zero() {
        assert_eq!(window_samples(10, 3, 2), 8); // ceil(10 / 3) = 4 samples per shard
        assert_eq!(window_samples(10, 3, 0), 1);
        assert_eq!(window_samples(10, 0, 5), 50);
        assert_eq!(window_samples(u64::MAX, 1, u32::MAX), u64::MAX);
    }

    #[test]
    fn a_full_window_is_a_uniform_permutation() {
        // window >= len: the buffer is drained in random order, i.e. a uniform shuffle.
        let mut rng = Rng::new(3);
        let mut counts = std::collections::HashMap::new();
        for _ in 0..60_000 {
            let mut v = [0u8, 1, 2];
            window_shuffle(&mut v, 100, &mut rng);
            *counts.entry(v).or_insert(0u32) += 1;
        }
        assert_eq!(counts.len(), 6);
        assert!(counts.values().all(|&c| (9_000..11_000).contains(&c)), "{counts:?}");
    }

    proptest! {
        #[test]
        fn window_shuffle_is_a_permutation_that_moves_items_less_than_a_window(
            len in 0usize..500, window in 0u64..600, seed: u64,
        ) {
            let mut v: Vec<usize> = (0..len).collect();
            window_shuffle(&mut v, window, &mut Rng::new(seed));
            let mut sorted = v.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..len).collect::<Vec<_>>());
            let w = usize::try_from(window.max(1)).unwrap();
            for (pos, &item) in v.iter().enumerate() {
                prop_assert!(pos.abs_diff(item) < w.max(2), "item {} at {} with window {}", item, pos, w);
            }
            if window <= 1 {
                prop_assert_eq!(v, (0..len).collect::<Vec<_>>());
            }
        }

        #[test]
        fn epochs_and_seeds_give_different_shard_orders(seed: u64, epoch in 0u64..1000) {
            // 20 shards: two independent uniform orders coincide with probability 1/20! ~ 4e-19.
            let a = shard_order(20, seed, epoch, true);
            prop_assert_ne!(&a, &shard_order(20, seed, epoch + 1, true));
            prop_assert_ne!(&a, &shard_order(20, seed.wrapping_add(1), epoch, true));
            prop_assert_eq!(&a, &shard_order(20, seed, epoch, true));
        }
    }
}
