//! GGUF k-quant tensors rewritten in the forms the CPU block kernels read, in one pass over the
//! file's bytes (the loader's torch version takes ~10 passes with fresh temporaries: most of a
//! large model's load).
//!
//! * Q4_K -> the Q4_1 kernel's form: per group of 32 a float32 scale `d * sc` and minimum
//!   `-(dmin * m)` (each product exact in float32) and 16 bytes of nibbles (byte j: value j in
//!   the low nibble, value j + 16 in the high one).
//! * Q4_K -> Q8G16 too, for a fused module whose other parts are Q6_K (values 0..15).
//! * Q5_K -> Q8G16: per group of 16 its group of 32's scale `d * sc` and minimum `-(dmin * m)`,
//!   and 32 int8 values 0..31 per group of 32 (four low bits, the fifth from the high-bit bytes).
//! * Q6_K -> Q8G16: per group of 16 a float32 scale `d * sc` (minimum 0) and 32 int8 values
//!   `q - 32` per group of 32.
//!
//! Invariants: the outputs are, value for value, what `python/ferrobatch/model/dequant.py`'s
//! `q4_nibbles` / `g16_parts` computed in torch from the same bytes (tested there, bit for bit); super-
//! blocks are independent, so the work splits over threads at any super-block boundary; input
//! lengths are checked before anything is written.

use crate::cpu_error::{check_lengths, KernelInputError};
use crate::load_parallel::{split, Out};
use half::f16;

/// Weights per super-block.
pub const SUPER: usize = 256;
/// Bytes of a Q4_K / Q5_K / Q6_K super-block.
pub const Q4_K_BYTES: usize = 144;
pub const Q5_K_BYTES: usize = 176;
pub const Q6_K_BYTES: usize = 210;

fn half_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// A Q4_K / Q5_K super-block's 8 sub-block scales `d * sc` and minimums `-(dmin * m)`: the
/// 6-bit values, the first four in the low bits of bytes 4-7 / 8-11, the last four in the
/// nibbles of bytes 12-15 with two high bits from bytes 4-7 / 8-11.
fn k_scales(block: &[u8]) -> ([f32; 8], [f32; 8]) {
    let (d, dmin) = (half_at(block, 0), half_at(block, 2));
    let packed = &block[4..16];
    let (low, high, mixed) = (&packed[0..4], &packed[4..8], &packed[8..12]);
    let (mut scale, mut min) = ([0f32; 8], [0f32; 8]);
    for i in 0..4 {
        let (sc_lo, m_lo) = (low[i] & 63, high[i] & 63);
        let sc_hi = (mixed[i] & 15) | ((low[i] >> 6) << 4);
        let m_hi = (mixed[i] >> 4) | ((high[i] >> 6) << 4);
        scale[i] = d * f32::from(sc_lo);
        scale[4 + i] = d * f32::from(sc_hi);
        min[i] = -(dmin * f32::from(m_lo));
        min[4 + i] = -(dmin * f32::from(m_hi));
    }
    (scale, min)
}

/// One Q4_K super-block -> 8 scales, 8 minimums and 8 x 16 nibble bytes.
fn q4_k_block(block: &[u8], scale: &mut [f32], min: &mut [f32], nibbles: &mut [u8]) {
    let (sc, mn) = k_scales(block);
    scale.copy_from_slice(&sc);
    min.copy_from_slice(&mn);
    // chunk c (32 bytes): sub-block 2c is its low nibbles, 2c + 1 its high ones
    for (c, chunk) in block[16..].chunks_exact(32).enumerate() {
        let (first, second) = chunk.split_at(16);
        let (even, odd) = nibbles[c * 32..(c + 1) * 32].split_at_mut(16);
        for j in 0..16 {
            even[j] = (first[j] & 0x0F) | ((second[j] & 0x0F) << 4);
            odd[j] = (first[j] >> 4) | (second[j] & 0xF0);
        }
    }
}

/// One Q5_K super-block -> 16 scales and 16 minimums (each group of 32's for both its halves)
/// and 256 int8 values: chunk c of the 128 low-bit bytes gives sub-block 2c its low nibbles
/// and 2c + 1 its high ones; bit s of the 32 high-bit bytes is sub-block s's fifth bit.
fn q5_k_block(block: &[u8], scale: &mut [f32], min: &mut [f32], q: &mut [i8]) {
    k_block_g16(block, &block[48..176], Some(&block[16..48]), scale, min, q);
}

/// One Q4_K super-block in Q8G16's form (a fused module whose other parts are not Q4_K, as
/// llama.cpp's Q4_K_M mixes a Q6_K v into Q4_K q / k): [`q5_k_block`] without fifth bits.
fn q4_k_block_g16(block: &[u8], scale: &mut [f32], min: &mut [f32], q: &mut [i8]) {
    k_block_g16(block, &block[16..144], None, scale, min, q);
}

/// A Q4_K / Q5_K super-block (`low`: its 128 bytes of low bits, `high`: Q5_K's 32 bytes of
/// fifth bits) as Q8G16's 16 scales, 16 minimums and 256 values.
fn k_block_g16(
    block: &[u8],
    low: &[u8],
    high: Option<&[u8]>,
    scale: &mut [f32],
    min: &mut [f32],
    q: &mut [i8],
) {
    let (sc, mn) = k_scales(block);
    for s in 0..8 {
        scale[2 * s..2 * s + 2].fill(sc[s]);
        min[2 * s..2 * s + 2].fill(mn[s]);
    }
    for (c, chunk) in low.chunks_exact(32).enumerate() {
        let (even, odd) = q[c * 64..(c + 1) * 64].split_at_mut(32);
        for i in 0..32 {
            let fifth = |s: usize| high.map_or(0, |qh| ((qh[i] >> s) & 1) << 4);
            even[i] = ((chunk[i] & 0x0F) | fifth(2 * c)) as i8;
            odd[i] = ((chunk[i] >> 4) | fifth(2 * c + 1)) as i8;
        }
    }
}

/// One Q6_K super-block -> 16 scales, 16 zero minimums and 256 int8 values.
fn q6_k_block(block: &[u8], scale: &mut [f32], min: &mut [f32], q: &mut [i8]) {
    min.fill(0.0);
    let d = half_at(block, 208);
    for (s, &sc) in scale.iter_mut().zip(&block[192..208]) {
        *s = d * f32::from(sc as i8);
    }
    // two halves of 128: 64 bytes of low bits give runs of 32 (low nibbles of bytes 0-31,
    // of 32-63, then their high nibbles), 32 bytes of high bits two bits per run
    for h in 0..2 {
        let (ql, qh) = (
            &block[h * 64..h * 64 + 64],
            &block[128 + h * 32..128 + h * 32 + 32],
        );
        for r in 0..4 {
            let out = &mut q[(h * 4 + r) * 32..][..32];
            let low = &ql[(r % 2) * 32..][..32];
            for i in 0..32 {
                let lo = if r < 2 { low[i] & 0x0F } else { low[i] >> 4 };
                let hi = (qh[i] >> (2 * r)) & 3;
                out[i] = ((lo | (hi << 4)) as i8).wrapping_sub(32);
            }
        }
    }
}

/// Q4_K bytes (whole super-blocks) -> the Q4_1 kernel's `scale`, `min` (one per 32) and
/// `nibbles` (16 bytes per 32), on up to `threads` threads.
pub fn q4_k_to_q4_1(
    raw: &[u8],
    scale: &mut [f32],
    min: &mut [f32],
    nibbles: &mut [u8],
    threads: usize,
) -> Result<(), KernelInputError> {
    let outputs = ((scale, 8), (min, 8), (nibbles, 128));
    convert(raw, Q4_K_BYTES, q4_k_block, outputs, threads)
}

/// GGUF type ids of the k-quants [`k_quant_to_q8_g16`] converts.
pub const Q4_K: u32 = 12;
pub const Q5_K: u32 = 13;
pub const Q6_K: u32 = 14;

/// Q4_K, Q5_K or Q6_K bytes (GGUF type `kind`, whole super-blocks) -> Q8G16's `scale` and
/// `min` (one per 16; Q6_K's minimums zero) and int8 `q` (one per weight: Q4_K's 0..15,
/// Q5_K's 0..31, Q6_K's `q - 32`), on up to `threads` threads.
pub fn k_quant_to_q8_g16(
    kind: u32,
    raw: &[u8],
    scale: &mut [f32],
    min: &mut [f32],
    q: &mut [i8],
    threads: usize,
) -> Result<(), KernelInputError> {
    let (size, block_fn): (usize, BlockFn<f32, f32, i8>) = match kind {
        Q4_K => (Q4_K_BYTES, q4_k_block_g16),
        Q5_K => (Q5_K_BYTES, q5_k_block),
        Q6_K => (Q6_K_BYTES, q6_k_block),
        _ => {
            return Err(KernelInputError(format!(
                "GGUF type {kind} is not Q4_K, Q5_K or Q6_K"
            )))
        }
    };
    let outputs = ((scale, 16), (min, 16), (q, SUPER));
    convert(raw, size, block_fn, outputs, threads)
}

/// One super-block's conversion: its bytes -> its runs of the three outputs.
type BlockFn<A, B, C> = fn(&[u8], &mut [A], &mut [B], &mut [C]);

/// Three outputs, each with the elements one super-block gives it.
type Outputs<'a, A, B, C> = (
    (&'a mut [A], usize),
    (&'a mut [B], usize),
    (&'a mut [C], usize),
);

/// The conversions' shared body: super-blocks of `size` bytes, each turned by `block_fn` into
/// its run of each output, split over up to `threads` threads; every length checked first.
fn convert<A, B, C>(
    raw: &[u8],
    size: usize,
    block_fn: BlockFn<A, B, C>,
    ((a, per_a), (b, per_b), (c, per_c)): Outputs<'_, A, B, C>,
    threads: usize,
) -> Result<(), KernelInputError> {
    let blocks = raw.len() / size;
    check_lengths(&[
        ("raw", raw.len(), blocks * size),
        ("scale", a.len(), blocks * per_a),
        ("min", b.len(), blocks * per_b),
        ("values", c.len(), blocks * per_c),
    ])?;
    let (oa, ob, oc) = (
        Out(a.as_mut_ptr()),
        Out(b.as_mut_ptr()),
        Out(c.as_mut_ptr()),
    );
    split(blocks, threads, |first, count| {
        for i in first..first + count {
            // SAFETY: super-block i's runs of the outputs; the threads' ranges are disjoint
            unsafe {
                block_fn(
                    &raw[i * size..][..size],
                    oa.range(i * per_a, per_a),
                    ob.range(i * per_b, per_b),
                    oc.range(i * per_c, per_c),
                );
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_give_the_same_values_and_bad_lengths_write_nothing() {
        let raw: Vec<u8> = (0..Q4_K_BYTES * 5).map(|i| (i * 37 % 251) as u8).collect();
        let run = |threads| {
            let (mut s, mut m, mut n) = (vec![0f32; 40], vec![0f32; 40], vec![0u8; 640]);
            q4_k_to_q4_1(&raw, &mut s, &mut m, &mut n, threads).unwrap();
            (s, m, n)
        };
        assert_eq!(run(1), run(3));
        let mut short = vec![7f32; 39];
        let err = q4_k_to_q4_1(&raw, &mut short, &mut [0f32; 40], &mut [0u8; 640], 2);
        assert!(err.is_err() && short.iter().all(|&v| v == 7.0));
        let raw6: Vec<u8> = (0..Q6_K_BYTES * 3).map(|i| (i * 53 % 241) as u8).collect();
        let run6 = |threads| {
            let (mut s, mut m, mut q) = (vec![0f32; 48], vec![7f32; 48], vec![0i8; 768]);
            k_quant_to_q8_g16(Q6_K, &raw6, &mut s, &mut m, &mut q, threads).unwrap();
            assert!(m.iter().all(|&v| v == 0.0));
            (s, q)
        };
        assert_eq!(run6(1), run6(2));
        let raw5: Vec<u8> = (0..Q5_K_BYTES * 3).map(|i| (i * 71 % 239) as u8).collect();
        let run5 = |threads| {
            let (mut s, mut m, mut q) = (vec![0f32; 48], vec![0f32; 48], vec![0i8; 768]);
            k_quant_to_q8_g16(Q5_K, &raw5, &mut s, &mut m, &mut q, threads).unwrap();
            (s, m, q)
        };
        assert_eq!(run5(1), run5(2));
        assert!(run5(1).2.iter().all(|&v| (0..32).contains(&v)));
        // Q4_K in Q8G16's form: each group of 32's scale / minimum twice, the nibbles as values
        let (s4, m4, n4) = run(2);
        let (mut s, mut m, mut q) = (vec![0f32; 80], vec![0f32; 80], vec![0i8; 1280]);
        k_quant_to_q8_g16(Q4_K, &raw, &mut s, &mut m, &mut q, 2).unwrap();
        for g in 0..40 {
            assert_eq!([s[2 * g], s[2 * g + 1]], [s4[g], s4[g]]);
            assert_eq!([m[2 * g], m[2 * g + 1]], [m4[g], m4[g]]);
            for j in 0..16 {
                let byte = n4[g * 16 + j];
                let want = [(byte & 15) as i8, (byte >> 4) as i8];
                assert_eq!([q[g * 32 + j], q[g * 32 + j + 16]], want);
            }
        }
        let bad = k_quant_to_q8_g16(
            Q6_K,
            &raw6[1..],
            &mut [0f32; 48],
            &mut [0f32; 48],
            &mut [0i8; 768],
            1,
        );
        assert!(bad.is_err());
    }
}
