//! A small seeded random number generator: xoshiro256** seeded through splitmix64.
//!
//! Both are the public-domain reference algorithms by Blackman and Vigna
//! (<https://prng.di.unimi.it/>). They are fast, have a 2^256 - 1 period and pass
//! BigCrush, which is far more than sampling needs. A dependency such as `rand` would
//! also work, but its output for a given seed may change between versions, and Kiln
//! promises that a seeded request repeats exactly.

/// The per-request generator. Same seed, same sequence, on every platform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rng {
    state: [u64; 4],
}

/// One step of splitmix64: advances `state` and returns the next output.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    /// Expands a 64-bit seed into the 256-bit state with splitmix64, as the
    /// xoshiro authors recommend. The state is never all zeros, because splitmix64
    /// is a bijection of its counter and four consecutive outputs cannot all be zero.
    pub(crate) fn from_seed(seed: u64) -> Self {
        let mut sm = seed;
        let state = [
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ];
        Rng { state }
    }

    /// The next 64 random bits (xoshiro256**).
    pub(crate) fn next_u64(&mut self) -> u64 {
        let s = &mut self.state;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform `f64` in [0, 1) from the top 53 bits of one `next_u64`.
    pub(crate) fn next_f64(&mut self) -> f64 {
        const SCALE: f64 = 1.0 / (1u64 << 53) as f64;
        (self.next_u64() >> 11) as f64 * SCALE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_reference_vector() {
        // Reference outputs of Vigna's splitmix64.c for seed 1234567.
        let mut state = 1_234_567;
        let got: Vec<u64> = (0..5).map(|_| splitmix64(&mut state)).collect();
        assert_eq!(
            got,
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423,
                4_593_380_528_125_082_431,
                16_408_922_859_458_223_821,
            ]
        );
    }

    #[test]
    fn xoshiro256starstar_matches_reference_vector() {
        // Reference outputs for the raw state [1, 2, 3, 4] (as in rand_xoshiro's tests).
        let mut rng = Rng {
            state: [1, 2, 3, 4],
        };
        let got: Vec<u64> = (0..10).map(|_| rng.next_u64()).collect();
        assert_eq!(
            got,
            [
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
            ]
        );
    }

    #[test]
    fn f64_is_in_unit_interval_and_seeds_differ() {
        let mut a = Rng::from_seed(1);
        let mut b = Rng::from_seed(2);
        let xs: Vec<f64> = (0..1000).map(|_| a.next_f64()).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let ys: Vec<f64> = (0..1000).map(|_| b.next_f64()).collect();
        assert_ne!(xs, ys);
        assert_eq!(Rng::from_seed(1).next_u64(), Rng::from_seed(1).next_u64());
    }
}
