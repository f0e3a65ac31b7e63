//! A tiny deterministic generator for the CPU kernels' unit tests (no `rand` dependency).

/// 64-bit linear congruential generator.
pub struct Lcg(pub u64);

impl Lcg {
    fn step(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0
    }

    /// Uniform in [-1, 1).
    pub fn next_f32(&mut self) -> f32 {
        ((self.step() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Uniform over all 32-bit patterns.
    pub fn next_u32(&mut self) -> u32 {
        (self.step() >> 32) as u32
    }

    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        ((self.step() >> 33) as usize) % n
    }

    /// `len` values of [`Lcg::next_f32`].
    pub fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| self.next_f32()).collect()
    }
}
