//! xorshift64*: reproducible random cases for the property tests, without a dependency.

pub struct Rng(pub u64);

impl Rng {
    #[allow(clippy::should_implement_trait)] // an endless generator, not an iterator
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
