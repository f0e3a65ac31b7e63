//! The Intel AMX instructions the AMX kernels (`cpu_amx_linear`, `cpu_amx_prefill`) share, as
//! inline assembly (Rust's AMX intrinsics are not stable): the tile configuration, its load and
//! release, and one macro per tile instruction; plus the exact split of float32 numbers into
//! three bfloat16 parts that both kernels multiply with.
//!
//! Invariants: these are only reached where `Isa::detect` returned `Isa::Amx` (the CPU has
//! AMX-TILE, AMX-BF16, AVX-512F and -BW, and Linux granted the tile state); a thread loads a
//! configuration before its first tile instruction and releases the tiles when its task ends.
//! Tile registers are not touched by compiled Rust code, so they keep their values between
//! `asm!` blocks of one thread.

/// A palette-1 tile configuration (`LDTILECFG`'s 64-byte operand).
#[repr(C, align(64))]
pub(crate) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Tiles `0..rows.len()` (at most 8) of `rows[t]` rows (1..=16) of 64 bytes; the others
    /// unused.
    pub(crate) fn new(rows: &[u8]) -> TileConfig {
        assert!(rows.len() <= 8 && rows.iter().all(|&r| (1..=16).contains(&r)));
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for (t, &r) in rows.iter().enumerate() {
            c.bytes_per_row[t] = 64;
            c.rows[t] = r;
        }
        c
    }

    /// `LDTILECFG`.
    ///
    /// # Safety
    /// AMX permitted for this process (`Isa::detect` gave `Isa::Amx`).
    #[cfg(target_arch = "x86_64")]
    pub(crate) unsafe fn load(&self) {
        // SAFETY: the caller's contract; `self` is a valid palette-1 configuration (new).
        unsafe {
            std::arch::asm!("ldtilecfg [{0}]", in(reg) self as *const TileConfig, options(nostack))
        };
    }
}

/// `TILERELEASE`: returns this thread's tiles to their initial state.
///
/// # Safety
/// AMX permitted for this process.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn release() {
    // SAFETY: the caller's contract.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
}

/// `TILEZERO tmmN`. Unsafe: the tiles must be configured.
macro_rules! tile_zero {
    ($tmm:literal) => {
        ::std::arch::asm!(concat!("tilezero ", $tmm), options(nostack, nomem))
    };
}

/// `TILELOADD tmmN, [ptr + stride * row]`: the configured rows of 64 bytes, `stride` bytes
/// apart. Unsafe: the tiles must be configured and every row readable.
macro_rules! tile_load {
    ($tmm:literal, $ptr:expr, $stride:expr) => {
        ::std::arch::asm!(
            concat!("tileloadd ", $tmm, ", [{p} + {s}*1]"),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack, readonly)
        )
    };
}

/// `TILESTORED [ptr + stride * row], tmmN`. Unsafe: the tiles must be configured and every row
/// writable.
macro_rules! tile_store {
    ($tmm:literal, $ptr:expr, $stride:expr) => {
        ::std::arch::asm!(
            concat!("tilestored [{p} + {s}*1], ", $tmm),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack)
        )
    };
}

/// `TDPBF16PS c, a, b`: `c[m][n] += sum_k a[m][2k] b[k][2n] + a[m][2k+1] b[k][2n+1]` (float32
/// sums of exact bfloat16 products). Unsafe: the tiles must be configured.
macro_rules! tile_dp {
    ($c:literal, $a:literal, $b:literal) => {
        ::std::arch::asm!(
            concat!("tdpbf16ps ", $c, ", ", $a, ", ", $b),
            options(nostack, nomem)
        )
    };
}

pub(crate) use {tile_dp, tile_load, tile_store, tile_zero};

/// The bfloat16 bit pattern of `v` (its top 16 bits; exact when the low 16 are zero).
pub(crate) fn bf16_bits(v: f32) -> u16 {
    (v.to_bits() >> 16) as u16
}

/// `x` as three bfloat16 numbers whose sum is `x` exactly: each part is the float32 with all but
/// the top 8 significant bits of what is left cleared, so each subtraction is exact.
#[inline]
pub(crate) fn split3(x: f32) -> [u16; 3] {
    let top = f32::from_bits(x.to_bits() & 0xFFFF_0000);
    let rest = x - top;
    let middle = f32::from_bits(rest.to_bits() & 0xFFFF_0000);
    [bf16_bits(top), bf16_bits(middle), bf16_bits(rest - middle)]
}

/// [`split3`] of 16 floats at once, each part as float32 bit patterns whose low 16 bits are
/// zero (a low part below 2^-126 keeps only its bits that a bfloat16 holds, as `split3`'s
/// does: callers may pack two parts into one 32-bit lane).
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn split3_bits(x: std::arch::x86_64::__m512) -> [std::arch::x86_64::__m512i; 3] {
    use std::arch::x86_64::*;
    let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let top = _mm512_and_si512(_mm512_castps_si512(x), high);
    let rest = _mm512_sub_ps(x, _mm512_castsi512_ps(top));
    let middle = _mm512_and_si512(_mm512_castps_si512(rest), high);
    let low = _mm512_castps_si512(_mm512_sub_ps(rest, _mm512_castsi512_ps(middle)));
    [top, middle, _mm512_and_si512(low, high)]
}

/// [`split3`] of 16 floats at once: the three parts' 16 bfloat16 each.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn split3_16(x: std::arch::x86_64::__m512) -> [std::arch::x86_64::__m256i; 3] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's CPU features.
    unsafe { split3_bits(x) }.map(|part| _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(part)))
}

/// The `len` elements of `buffer` (at least `len + 32` long) that start on a 64-byte boundary:
/// a tile row that straddles two cache lines costs two accesses (measured ~1.5x slower).
pub fn aligned_64(buffer: &mut [u16], len: usize) -> &mut [u16] {
    let skip = buffer.as_ptr().align_offset(64).min(32);
    &mut buffer[skip..skip + len]
}

/// A pointer shared by the pool's tasks, each of which touches only its own disjoint range.
#[derive(Clone, Copy)]
pub(crate) struct Shared<T>(pub(crate) *mut T);
// SAFETY: only used to hand disjoint ranges of one live buffer to the pool's tasks.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The pointer (a method, so closures capture the whole `Shared`, not its raw field).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    fn bf16_value(bits: u16) -> f32 {
        f32::from_bits((bits as u32) << 16)
    }

    #[test]
    fn split3_parts_sum_to_x_exactly_and_the_vector_split_agrees() {
        let mut rng = Lcg(5);
        let mut xs: Vec<f32> = rng.vec(4096).iter().map(|x| x * 1e3).collect();
        xs.extend([
            0.0,
            -0.0,
            1.0,
            -3.5,
            1e-30,
            3.4e38,
            f32::MIN_POSITIVE,
            0.1,
            1.0 / 3.0,
        ]);
        xs.resize(xs.len().next_multiple_of(16), 0.7);
        for &x in &xs {
            let [h, m, l] = split3(x);
            let sum = bf16_value(h) as f64 + bf16_value(m) as f64 + bf16_value(l) as f64;
            assert_eq!(sum, x as f64, "{x}");
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            for chunk in xs.chunks_exact(16) {
                let mut got = [[0u16; 16]; 3];
                // SAFETY: AVX-512F detected; each store writes 16 u16 into a 16-element row.
                unsafe {
                    use std::arch::x86_64::*;
                    let parts = split3_16(_mm512_loadu_ps(chunk.as_ptr()));
                    for (row, part) in got.iter_mut().zip(parts) {
                        _mm256_storeu_si256(row.as_mut_ptr().cast(), part);
                    }
                }
                for (i, &x) in chunk.iter().enumerate() {
                    assert_eq!([got[0][i], got[1][i], got[2][i]], split3(x), "{x}");
                }
            }
        }
    }
}
