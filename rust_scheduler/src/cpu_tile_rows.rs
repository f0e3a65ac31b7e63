//! Steps of a few rows read straight from the AMX kernel's packed weights (`cpu_amx_linear`'s
//! `Int8` and `Nibbles` chunks) with AVX-512 multiply-adds, no tile instructions: so a layer
//! whose steps of [`cpu_amx_linear::min_rows`] rows or more take its tiles can serve its smaller
//! steps from the same bytes and keep no GGUF blocks beside them.
//!
//! A chunk row `r` holds inputs `32b + 2r` and `32b + 2r + 1` of 16 features, interleaved; each
//! row is widened to two vectors of 16 float32 integers (lanes: a feature and an input parity,
//! the features of each vector in [`lane_features`]' order), multiplied by the broadcast input
//! pair and summed over the chunk's 16 rows per lane (`S`); then `acc += S * scale` with each
//! lane's feature's scale, and, for Q4_1, `min * sum(x over the block)` per feature. The two
//! lanes of a feature are added once at the end of its tile. The products are those of the
//! real-number weights `scale * q + min`, summed in float32: the results differ from the GGUF
//! block kernel's (`cpu_quant_linear`) at float32-rounding level.
//!
//! Invariants: as [`AmxShape::validate`], plus `m <= MAX_ROWS`; runs only where
//! [`cpu_amx_linear::available`] (AVX-512F and -BW with it). Work split: feature tiles in
//! contiguous ranges, one per task; a task writes only its own columns of `out`.

use crate::cpu_amx_linear::{
    self, AmxFormat, AmxShape, AmxTiles, BLOCK, INT8_CHUNK, NIBBLE_CHUNK, TILE_FEATURES,
};
use crate::cpu_error::KernelInputError;
use crate::cpu_linear::OutPtr;

/// The most rows a call takes: at least every step below `cpu_amx_linear::MIN_ROWS` (the
/// layers that keep their tiles alone are sent the steps below their `min_rows`).
pub const MAX_ROWS: usize = 4;
const _: () = assert!(cpu_amx_linear::MIN_ROWS - 1 <= MAX_ROWS);

/// The feature each lane of a chunk row's two widened vectors (`[first, second]`) belongs to:
/// `Int8` rows widen bytes 0..16 and 16..32 in `INT8_SLOT`'s order, `Nibbles` rows positions
/// 0..16 and 16..32 (position `p`: feature `p / 2`, input parity `p % 2`, in both formats).
pub fn lane_features(format: AmxFormat) -> [[usize; TILE_FEATURES]; 2] {
    let mut lanes = [[0; TILE_FEATURES]; 2];
    for (half, features) in lanes.iter_mut().enumerate() {
        for (s, f) in features.iter_mut().enumerate() {
            *f = match format {
                AmxFormat::Int8 => 4 * (s / 4) + 2 * half + (s % 4) / 2,
                AmxFormat::Nibbles => 8 * half + s / 2,
            };
        }
    }
    lanes
}

/// `out = x @ W^T + bias` for `m <= MAX_ROWS` rows, `W` packed by `cpu_amx_linear::pack`;
/// `bias` may be empty. Splits the feature tiles over up to `num_threads` threads. Errors
/// instead of reading out of bounds, and where AMX (so AVX-512) is not available.
pub fn linear_tile_rows_f32(
    shape: &AmxShape,
    x: &[f32],
    tiles: AmxTiles<'_>,
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
) -> Result<(), KernelInputError> {
    shape.validate(x, &tiles, bias, out)?;
    if shape.m > MAX_ROWS {
        return Err(KernelInputError(format!(
            "{} rows: the tiles' few-row kernel takes at most {MAX_ROWS}",
            shape.m
        )));
    }
    if !cpu_amx_linear::available() {
        return Err(KernelInputError(
            "AMX is not available on this machine (or FERROBATCH_CPU_ISA caps it)".into(),
        ));
    }
    if shape.m == 0 {
        return Ok(());
    }
    let AmxShape { m, n, k } = *shape;
    let nb = k / BLOCK;
    let sums: Vec<f32> = x
        .chunks_exact(BLOCK)
        .map(|block| block.iter().sum())
        .collect();
    let feature_tiles = n.div_ceil(TILE_FEATURES);
    let threads = num_threads
        .clamp(1, feature_tiles)
        .min(1 + 4 * n * k / (1 << 18));
    let pool = (threads > 1).then(|| crate::cpu_pool::global(threads));
    let threads = pool.map_or(1, |p| threads.min(p.max_tasks()));
    let kernel = Kernel {
        shape: *shape,
        x,
        sums: &sums,
        tiles,
        bias,
        out: OutPtr(out.as_mut_ptr()),
        nb,
    };
    match pool {
        // SAFETY: AMX available (checked above) implies AVX-512F and -BW; one thread writes
        // every column.
        None => unsafe { kernel.run_tiles(0, feature_tiles, m) },
        Some(pool) => {
            let per_task = feature_tiles.div_ceil(threads);
            pool.run(threads, &|t| {
                let first = (t * per_task).min(feature_tiles);
                let last = ((t + 1) * per_task).min(feature_tiles);
                // SAFETY: as above; task t writes only the columns of tiles first..last.
                unsafe { kernel.run_tiles(first, last, m) };
            });
        }
    }
    Ok(())
}

struct Kernel<'a> {
    shape: AmxShape,
    x: &'a [f32],
    /// `[M, K / 32]` block sums of `x`
    sums: &'a [f32],
    tiles: AmxTiles<'a>,
    bias: &'a [f32],
    out: OutPtr,
    nb: usize,
}

impl Kernel<'_> {
    /// Feature tiles `first..last`, every row.
    ///
    /// # Safety
    /// The CPU has AVX-512F and -BW; no other thread writes those columns of `out` meanwhile.
    unsafe fn run_tiles(&self, first: usize, last: usize, m: usize) {
        #[cfg(target_arch = "x86_64")]
        for t in first..last {
            // SAFETY: the caller's contract, with R == m.
            unsafe {
                match (self.tiles.format, m) {
                    (AmxFormat::Int8, 1) => self.tile::<1, false>(t),
                    (AmxFormat::Int8, 2) => self.tile::<2, false>(t),
                    (AmxFormat::Int8, 3) => self.tile::<3, false>(t),
                    (AmxFormat::Int8, _) => self.tile::<4, false>(t),
                    (AmxFormat::Nibbles, 1) => self.tile::<1, true>(t),
                    (AmxFormat::Nibbles, 2) => self.tile::<2, true>(t),
                    (AmxFormat::Nibbles, 3) => self.tile::<3, true>(t),
                    (AmxFormat::Nibbles, _) => self.tile::<4, true>(t),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (first, last, m);
    }

    /// Every row (`R` of them) of feature tile `t`; `NIBBLES`: the chunks' format.
    ///
    /// # Safety
    /// As [`Kernel::run_tiles`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn tile<const R: usize, const NIBBLES: bool>(&self, t: usize) {
        use std::arch::x86_64::*;
        const { assert!(R <= MAX_ROWS) };
        let AmxShape { n, k, .. } = self.shape;
        let (format, chunk_len) = if NIBBLES {
            (AmxFormat::Nibbles, NIBBLE_CHUNK)
        } else {
            (AmxFormat::Int8, INT8_CHUNK)
        };
        let ints_len = chunk_len - if NIBBLES { 4 } else { 2 } * TILE_FEATURES;
        let lanes = lane_features(format);
        let index = lanes.map(|half| {
            let idx: [i32; TILE_FEATURES] = std::array::from_fn(|s| half[s] as i32);
            // SAFETY: reads 16 i32.
            unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) }
        });
        let low4 = _mm512_set1_epi32(0x0F);
        let mut acc = [[_mm512_setzero_ps(); 2]; R];
        let mut acc_min = [_mm512_setzero_ps(); R];
        let tile = &self.tiles.data[t * self.nb * chunk_len..][..self.nb * chunk_len];
        for (b, chunk) in tile.chunks_exact(chunk_len).enumerate() {
            let ints = chunk.as_ptr().cast::<u8>();
            let mut s = [[_mm512_setzero_ps(); 2]; R];
            // adds chunk row r's widened integers `w` times row i's input pair, for every row
            let mut add_row = |r: usize, w: [__m512; 2]| {
                for (i, s) in s.iter_mut().enumerate() {
                    // SAFETY: inputs 32b + 2r, +1 of row i: inside x (length m * k).
                    let pair = unsafe {
                        let p = self.x.as_ptr().add(i * k + b * BLOCK + 2 * r);
                        _mm512_castpd_ps(_mm512_set1_pd(std::ptr::read_unaligned(p.cast())))
                    };
                    s[0] = _mm512_fmadd_ps(w[0], pair, s[0]);
                    s[1] = _mm512_fmadd_ps(w[1], pair, s[1]);
                }
            };
            if NIBBLES {
                for g in 0..TILE_FEATURES / 2 {
                    // rows 2g and 2g + 1: the low and high nibbles of the group's 32 bytes
                    // SAFETY: bytes 32g..32g+32 of the chunk's 256.
                    let bytes = |h: usize| unsafe {
                        _mm512_cvtepu8_epi32(_mm_loadu_si128(ints.add(32 * g + 16 * h).cast()))
                    };
                    let v = [bytes(0), bytes(1)];
                    let low = v.map(|v| _mm512_cvtepi32_ps(_mm512_and_si512(v, low4)));
                    let high = v.map(|v| _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v)));
                    add_row(2 * g, low);
                    add_row(2 * g + 1, high);
                }
            } else {
                for r in 0..TILE_FEATURES {
                    // SAFETY: row r is bytes 32r..32r+32 of the chunk's 512.
                    let half = |h: usize| unsafe {
                        let bytes = _mm_loadu_si128(ints.add(32 * r + 16 * h).cast());
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))
                    };
                    add_row(r, [half(0), half(1)]);
                }
            }
            // SAFETY: the chunk's parameters: 16 scales (and, for nibbles, 16 mins) as float32.
            let params = unsafe { chunk.as_ptr().add(ints_len).cast::<f32>() };
            let scale = unsafe { _mm512_loadu_ps(params) };
            let scales = index.map(|idx| _mm512_permutexvar_ps(idx, scale));
            // SAFETY: for nibbles the mins follow the scales (Int8 chunks have none: zero)
            let min = if NIBBLES {
                unsafe { _mm512_loadu_ps(params.add(TILE_FEATURES)) }
            } else {
                _mm512_setzero_ps()
            };
            for i in 0..R {
                acc[i][0] = _mm512_fmadd_ps(s[i][0], scales[0], acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(s[i][1], scales[1], acc[i][1]);
                if NIBBLES {
                    let sum = _mm512_set1_ps(self.sums[i * self.nb + b]);
                    acc_min[i] = _mm512_fmadd_ps(min, sum, acc_min[i]);
                }
            }
        }
        let col0 = t * TILE_FEATURES;
        let width = (n - col0).min(TILE_FEATURES);
        for i in 0..R {
            let mut total = [0f32; TILE_FEATURES];
            // SAFETY: stores 16 floats.
            unsafe { _mm512_storeu_ps(total.as_mut_ptr(), acc_min[i]) };
            for (half, features) in lanes.iter().enumerate() {
                let mut lane = [0f32; TILE_FEATURES];
                // SAFETY: stores 16 floats.
                unsafe { _mm512_storeu_ps(lane.as_mut_ptr(), acc[i][half]) };
                for (v, &f) in lane.iter().zip(features) {
                    total[f] += v;
                }
            }
            for (c, &v) in total.iter().enumerate().take(width) {
                let bias = self.bias.get(col0 + c).copied().unwrap_or(0.0);
                // SAFETY: row i < m, column col0 + c < n: inside `out`, a column this task owns.
                unsafe { *self.out.0.add(i * n + col0 + c) = v + bias };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_quant_linear::tests::{dequantized, random_blocks};
    use crate::test_rng::Lcg;

    #[test]
    fn every_feature_has_two_lanes_of_opposite_parity() {
        for format in [AmxFormat::Int8, AmxFormat::Nibbles] {
            let lanes = lane_features(format);
            for f in 0..TILE_FEATURES {
                let mut parities = Vec::new();
                for (half, features) in lanes.iter().enumerate() {
                    for (s, &g) in features.iter().enumerate() {
                        if g == f {
                            parities.push((half, s % 2));
                        }
                    }
                }
                assert_eq!(parities.len(), 2, "{format:?} feature {f}");
                assert_ne!(parities[0].1, parities[1].1, "{format:?} feature {f}");
            }
        }
    }

    #[test]
    #[ignore = "needs AMX: `make test` runs it where the CPU has it"]
    fn matches_a_float64_reference_and_the_amx_kernel() {
        assert!(cpu_amx_linear::available(), "AMX is not available here");
        let mut seed = 40;
        for &(n, k) in &[(16, 32), (33, 64), (200, 576), (37, 2048)] {
            for m in 1..=MAX_ROWS {
                for q4 in [true, false] {
                    seed += 1;
                    let mut rng = Lcg(seed);
                    let b = random_blocks(&mut rng, n, k);
                    let w = b.weight(q4);
                    let x: Vec<f32> = (0..m * k).map(|_| 3.0 * rng.next_f32()).collect();
                    let bias: Vec<f32> = if seed % 2 == 0 { rng.vec(n) } else { vec![] };
                    let packed = cpu_amx_linear::pack(&w, n, k).unwrap();
                    let tiles = AmxTiles {
                        format: AmxFormat::of(&w).unwrap(),
                        data: &packed,
                    };
                    let shape = AmxShape { m, n, k };
                    let (mut got, mut amx) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                    linear_tile_rows_f32(&shape, &x, tiles, &bias, &mut got, 1 + seed as usize % 3)
                        .unwrap();
                    cpu_amx_linear::linear_amx_f32(&shape, &x, tiles, &bias, &mut amx, 2).unwrap();
                    let wd = dequantized(&b, q4, n, k);
                    for r in 0..m {
                        for j in 0..n {
                            let (mut dot, mut mag) = (0f64, 0f64);
                            for i in 0..k {
                                let p = f64::from(x[r * k + i]) * f64::from(wd[j * k + i]);
                                dot += p;
                                mag += p.abs();
                            }
                            dot += bias.get(j).map_or(0.0, |&v| f64::from(v));
                            let tol = 4e-7 * (mag + 1.0);
                            let at = format!("n {n} k {k} m {m} q4 {q4} row {r} feature {j}");
                            assert!((f64::from(got[r * n + j]) - dot).abs() <= tol, "{at}");
                            let gap = (got[r * n + j] - amx[r * n + j]).abs();
                            assert!(f64::from(gap) <= 2.0 * tol, "{at} vs AMX");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rejects_too_many_rows_and_bad_shapes_touching_nothing() {
        let (n, k) = (20, 64);
        let tiles = vec![0u16; AmxShape { m: 0, n, k }.tiles_len(AmxFormat::Int8)];
        let tiles = AmxTiles {
            format: AmxFormat::Int8,
            data: &tiles,
        };
        for m in [MAX_ROWS + 1, 3] {
            let x = vec![1f32; m * k];
            let mut out = vec![7f32; m * n];
            let shape = AmxShape {
                m,
                n,
                k: if m == 3 { 32 } else { k },
            };
            assert!(linear_tile_rows_f32(&shape, &x, tiles, &[], &mut out, 2).is_err());
            assert!(out.iter().all(|&v| v == 7.0));
        }
    }
}
