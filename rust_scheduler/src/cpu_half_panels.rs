//! Float32 weights that a 16-bit float holds exactly, packed as 16-bit panels for the
//! quantized-panel kernel (`cpu_quant_panels`): a Hugging Face checkpoint stored in bfloat16
//! (most are) is loaded as float32 for the CPU, every weight a bfloat16 value with 16 zero low
//! bits, so `cpu_linear`'s float32 panels stream twice the bytes the weights hold. Packed here
//! as bfloat16 (or float16, for a float16 checkpoint or a GGUF's F16 tensors), each weight is
//! widened back to the very same float32 before the float32 panels' tile kernel multiplies it:
//! the output is `linear_f32`'s bit for bit, from half the bytes.
//!
//! Layout: per panel of 16 output features (`cpu_linear`'s panels; features past `N` are
//! zero), per block of 32 inputs, one 1,024-byte record: input `i`'s 16 features as 16-bit
//! values (`[32 inputs][16 features]`, little-endian), which is already the order
//! `cpu_quant_panels` unpacks into. Records of a panel follow each other (`K / 32`), panels
//! follow each other.
//!
//! A step of up to [`FEW_ROWS_AVX512`] rows (two on AVX2) takes `few_rows`: each weight
//! widened in a register and multiplied at once, for row tiles of up to 8 rows, a group of
//! panels at a time (its weights read from memory by the first tile, from cache by the
//! others), each row's sum from its bias over the inputs in order, as `linear_f32`'s tiles sum
//! it (so the same bits). Larger steps go through `cpu_quant_panels`' walk (records unpacked
//! into an L1 buffer, or a task's whole panels at once, then `cpu_linear`'s register tiles).
//!
//! Invariants: [`format_of`] names a format only if every weight comes back from it bit for bit
//! (checked value by value, before anything is packed); [`pack_into`] checks the weight's and
//! the output's lengths before writing; the unpackers read exactly one record and write
//! exactly 512 floats; `few_rows` asserts that its panels, `x`, `bias` and `out` hold what it
//! reads and writes.

use crate::cpu_error::{check_lengths, KernelInputError};
use crate::cpu_linear::PANEL_WIDTH;
use crate::cpu_quant_linear::{check_block_shape, BLOCK};
use crate::cpu_quant_panels::PanelFormat;
use crate::load_parallel::{load_threads, split, Out};
use half::f16;

/// Bytes of one (panel, block) record.
pub const RECORD: usize = 2 * BLOCK * PANEL_WIDTH;

/// `v`'s bfloat16 bits, where bfloat16 holds `v` exactly (its low 16 bits are zero).
fn bf16_bits(v: f32) -> Option<u16> {
    let bits = v.to_bits();
    (bits & 0xFFFF == 0).then_some((bits >> 16) as u16)
}

/// `v`'s float16 bits, where float16 holds `v` exactly (bit for bit once widened back).
fn f16_bits(v: f32) -> Option<u16> {
    let h = f16::from_f32(v);
    (h.to_f32().to_bits() == v.to_bits()).then_some(h.to_bits())
}

/// The 16-bit format that holds every value of `weight` bit for bit: bfloat16, else float16,
/// else None (checked over several threads: a large model's load).
pub fn format_of(weight: &[f32]) -> Option<PanelFormat> {
    let all = |exact: fn(f32) -> Option<u16>| {
        let misses = std::sync::atomic::AtomicBool::new(false);
        split(
            weight.len().div_ceil(1 << 16),
            load_threads(),
            |first, count| {
                let part = &weight
                    [(first << 16).min(weight.len())..((first + count) << 16).min(weight.len())];
                if part.iter().any(|&v| exact(v).is_none()) {
                    misses.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            },
        );
        !misses.into_inner()
    };
    if all(bf16_bits) {
        Some(PanelFormat::Bf16)
    } else if all(f16_bits) {
        Some(PanelFormat::F16)
    } else {
        None
    }
}

/// Bytes [`pack_into`] writes for a `[n, k]` weight (an error for a shape the kernel cannot
/// take: `k` a positive multiple of 32, `n` positive).
pub fn packed_len(n: usize, k: usize) -> Result<usize, KernelInputError> {
    check_block_shape(n, k)?;
    Ok(n.div_ceil(PANEL_WIDTH) * (k / BLOCK) * RECORD)
}

/// Packs the row-major `[n, k]` float32 `weight` into `data` ([`packed_len`] bytes) in
/// `format` (`Bf16` or `F16`, as [`format_of`] named it: an error for a value it does not hold).
pub fn pack_into(
    weight: &[f32],
    n: usize,
    k: usize,
    format: PanelFormat,
    data: &mut [u8],
) -> Result<(), KernelInputError> {
    check_lengths(&[
        ("weight", weight.len(), n * k),
        ("packed", data.len(), packed_len(n, k)?),
    ])?;
    let exact: fn(f32) -> Option<u16> = match format {
        PanelFormat::Bf16 => bf16_bits,
        PanelFormat::F16 => f16_bits,
        other => {
            return Err(KernelInputError(format!(
                "16-bit panels are bf16 or f16, not {other:?}"
            )))
        }
    };
    let nb = k / BLOCK;
    let panel_len = nb * RECORD;
    let out = Out(data.as_mut_ptr());
    let inexact = std::sync::atomic::AtomicBool::new(false);
    split(n.div_ceil(PANEL_WIDTH), load_threads(), |first, count| {
        // SAFETY: panels first .. first + count, this thread's alone
        let part = unsafe { out.range(first * panel_len, count * panel_len) };
        for (p, panel) in (first..).zip(part.chunks_exact_mut(panel_len)) {
            for c in 0..PANEL_WIDTH {
                let j = p * PANEL_WIDTH + c;
                let row = (j < n).then(|| &weight[j * k..(j + 1) * k]);
                for (i, v) in (0..k).map(|i| (i, row.map_or(0.0, |r| r[i]))) {
                    let Some(bits) = exact(v) else {
                        inexact.store(true, std::sync::atomic::Ordering::Relaxed);
                        return;
                    };
                    let at = (i / BLOCK) * RECORD + 2 * ((i % BLOCK) * PANEL_WIDTH + c);
                    panel[at..at + 2].copy_from_slice(&bits.to_le_bytes());
                }
            }
        }
    });
    if inexact.into_inner() {
        return Err(KernelInputError(format!(
            "a weight is not exactly a {format:?} value"
        )));
    }
    Ok(())
}

/// One record into `out[input][feature]` (512 floats), a value at a time.
pub(crate) fn unpack_portable(format: PanelFormat, rec: &[u8], out: &mut [f32]) {
    assert!(rec.len() == RECORD && out.len() == BLOCK * PANEL_WIDTH);
    for (o, b) in out.iter_mut().zip(rec.chunks_exact(2)) {
        let bits = u16::from_le_bytes([b[0], b[1]]);
        *o = match format {
            PanelFormat::Bf16 => f32::from_bits(u32::from(bits) << 16),
            _ => f16::from_bits(bits).to_f32(),
        };
    }
}

/// The most rows of a step `few_rows` takes on AVX-512: row tiles of up to `TILE_ROWS` (four
/// panels a pass up to 4 rows, two up to 8: at most 16 accumulators), each panel group's
/// weights read from memory once for all of them. SmolLM2 in bfloat16, every layer once per
/// round, 16-bit panels against float32 ones (`benches/half_panels.py`, session 51, runs a
/// few minutes apart with this limit at 8, 32, 128 or beyond): these tiles gave 1.38x / 1.53x /
/// 1.26x / 1.24x / 1.16x at 12 / 16 / 32 / 64 / 128 rows where the walk (an unpacked chunk,
/// then `cpu_linear`'s tiles) gave 1.21x / 1.29x / 1.11x / 1.00x / 1.01x; a later run 1.07x at
/// 64 and 0.98x at 128; level at 256-512 either way (0.98x-1.04x), where x no longer fits L2.
pub const FEW_ROWS_AVX512: usize = 64;
/// On AVX2 (one row: four panels a pass, two rows: two; 8 accumulators of 16 registers). With
/// the kernels capped at AVX2 (`FERROBATCH_CPU_ISA=avx2`, same bench): 2.11x at 2 rows where
/// the walk gave 1.49x; from 4 rows (one panel a pass) 1.52x / 1.61x / 1.39x / 1.03x at 4 / 8
/// / 16 / 64 against the walk's 1.65x / 1.65x / 1.47x / 1.15x: the walk takes those.
pub const FEW_ROWS_AVX2: usize = 2;

/// `m` rows (at most [`FEW_ROWS_AVX512`] / [`FEW_ROWS_AVX2`]): `out[r][j] = bias[j] + x[r] . w_j`
/// for the features of panels `first..last` of a `[n, k]` weight packed by [`pack_into`]
/// (`data`: all its panels; `x` `m * k`; `bias` empty or `n` long; `out` the whole output,
/// `m * n`, of which only those panels' columns are written).
///
/// # Safety
/// `isa` came from `Isa::detect` (this CPU has its features) and is AVX2 or wider; no other
/// thread writes those columns of `out` meanwhile.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn few_rows(
    isa: crate::cpu_isa::Isa,
    format: PanelFormat,
    (x, m): (&[f32], usize),
    data: &[u8],
    (n, k): (usize, usize),
    (first, last): (usize, usize),
    bias: &[f32],
    out: *mut f32,
) {
    use crate::cpu_isa::Isa;
    let nb = k / BLOCK;
    let wide = matches!(isa, Isa::Avx512 | Isa::Amx);
    assert!(k % BLOCK == 0 && x.len() == m * k && first <= last && last <= n.div_ceil(PANEL_WIDTH));
    assert!(data.len() >= last * nb * RECORD && (bias.is_empty() || bias.len() == n));
    assert!(m >= 1 && (wide || m <= FEW_ROWS_AVX2));
    assert!(wide || isa == Isa::Avx2);
    let bf16 = format == PanelFormat::Bf16;
    assert!(bf16 || format == PanelFormat::F16);
    // rows in near-equal tiles of at most TILE_ROWS (TILE_ROWS_AVX2); per tile, as many panels
    // a pass as the accumulators allow (the rest one at a time): AVX-512 16 of 32 registers,
    // AVX2 (two per panel and row) 8 to 12 of 16
    let tiles = m.div_ceil(if wide { TILE_ROWS } else { TILE_ROWS_AVX2 });
    let tallest = m.div_ceil(tiles);
    let group = match (wide, tallest) {
        (true, 1..=4) | (false, 1) => 4,
        (true, _) | (false, 2) => 2,
        (false, _) => 1,
    };
    let mut p = first;
    while p < last {
        let whole = last - p >= group;
        // the group's weights are read from memory by the first tile, from cache by the others
        let mut r0 = 0;
        for t in 0..tiles {
            let height = (m - r0) / (tiles - t);
            let a = x86::Args {
                bf16,
                x: &x[r0 * k..(r0 + height) * k],
                data,
                nb,
                k,
                n,
                bias,
                // SAFETY: row r0 of `out` (m * n long by the caller's contract)
                out: unsafe { out.add(r0 * n) },
            };
            macro_rules! rows {
                ($g:literal) => {
                    match height {
                        1 => x86::panels::<$g, 1>(wide, &a, p),
                        2 => x86::panels::<$g, 2>(wide, &a, p),
                        3 => x86::panels::<$g, 3>(wide, &a, p),
                        4 => x86::panels::<$g, 4>(wide, &a, p),
                        5 => x86::panels::<$g, 5>(wide, &a, p),
                        6 => x86::panels::<$g, 6>(wide, &a, p),
                        7 => x86::panels::<$g, 7>(wide, &a, p),
                        _ => x86::panels::<$g, 8>(wide, &a, p),
                    }
                };
            }
            // SAFETY: panels p..p + G lie inside `data`, their columns (clipped to n) of rows
            // r0..r0 + height inside `out` (asserts above; the caller owns them); the CPU has
            // `isa`
            unsafe {
                match (whole, group) {
                    (true, 4) => rows!(4),
                    (true, 2) => rows!(2),
                    _ => rows!(1),
                }
            }
            r0 += height;
        }
        p += if whole { group } else { 1 };
    }
}

/// Most rows of one register tile of `few_rows` (two panels: 16 accumulators on AVX-512).
const TILE_ROWS: usize = 8;
/// The same on AVX2 (one panel: 12 accumulators of 16 registers).
const TILE_ROWS_AVX2: usize = 6;

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{BLOCK, PANEL_WIDTH, RECORD};
    use crate::cpu_quant_panels::PanelFormat;
    use std::arch::x86_64::*;

    /// Sixteen bfloat16 (`bf16`) or float16 values as the float32 numbers they are (a bfloat16
    /// is a float32's high half).
    #[inline(always)]
    unsafe fn widen16(bf16: bool, halves: __m256i) -> __m512 {
        if bf16 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
        } else {
            _mm512_cvtph_ps(halves)
        }
    }

    /// [`widen16`] of eight values.
    #[inline(always)]
    unsafe fn widen8(bf16: bool, halves: __m128i) -> __m256 {
        if bf16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
        } else {
            _mm256_cvtph_ps(halves)
        }
    }

    /// Records ahead of the one being read that [`panels`] prefetches.
    const PREFETCH_RECORDS: usize = 2;

    /// Hints the CPU to fetch record `b` of panels `p..p + G` (a prefetch never faults).
    #[inline(always)]
    unsafe fn prefetch_records<const G: usize>(data: *const u8, nb: usize, p: usize, b: usize) {
        for g in 0..G {
            let base = data.wrapping_add(((p + g) * nb + b) * RECORD);
            for line in (0..RECORD).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(line).cast());
            }
        }
    }

    /// What [`panels`] reads and writes (see [`super::few_rows`]).
    pub(crate) struct Args<'a> {
        pub(crate) bf16: bool,
        pub(crate) x: &'a [f32],
        pub(crate) data: &'a [u8],
        pub(crate) nb: usize,
        pub(crate) k: usize,
        pub(crate) n: usize,
        pub(crate) bias: &'a [f32],
        pub(crate) out: *mut f32,
    }

    /// Panels `p..p + G` for the `R` rows of `a.x`, on AVX-512 (`wide`) or AVX2.
    ///
    /// # Safety
    /// As [`super::few_rows`], for these panels.
    #[inline(always)]
    pub(crate) unsafe fn panels<const G: usize, const R: usize>(
        wide: bool,
        a: &Args<'_>,
        p: usize,
    ) {
        // SAFETY: forwarded
        unsafe {
            if wide {
                panels_avx512::<G, R>(a, p)
            } else {
                panels_avx2::<G, R>(a, p)
            }
        }
    }

    /// Panels `p..p + G`, `R` rows, sixteen features a vector: each row's sum from the bias
    /// over the inputs in order (`linear_f32`'s tile order), each weight widened once for the
    /// `R` rows.
    ///
    /// # Safety
    /// AVX-512F; as [`super::few_rows`].
    #[target_feature(enable = "avx512f")]
    unsafe fn panels_avx512<const G: usize, const R: usize>(a: &Args<'_>, p: usize) {
        let Args {
            bf16,
            x,
            data,
            nb,
            k,
            n,
            bias,
            out,
        } = *a;
        // SAFETY: the caller's contract bounds every load and store below (masked to n)
        unsafe {
            let masks: [__mmask16; G] = std::array::from_fn(|g| {
                let cols = n.saturating_sub((p + g) * PANEL_WIDTH).min(PANEL_WIDTH);
                ((1u32 << cols) - 1) as __mmask16
            });
            let start: [__m512; G] = std::array::from_fn(|g| {
                if bias.is_empty() {
                    _mm512_setzero_ps()
                } else {
                    _mm512_maskz_loadu_ps(masks[g], bias.as_ptr().add((p + g) * PANEL_WIDTH))
                }
            });
            let mut acc = [start; R];
            let (base, xp) = (data.as_ptr(), x.as_ptr());
            for b in 0..nb {
                if b + PREFETCH_RECORDS < nb {
                    prefetch_records::<G>(base, nb, p, b + PREFETCH_RECORDS);
                }
                for i in 0..BLOCK {
                    let w: [__m512; G] = std::array::from_fn(|g| {
                        let at = base.add(((p + g) * nb + b) * RECORD + 2 * PANEL_WIDTH * i);
                        widen16(bf16, _mm256_loadu_si256(at.cast()))
                    });
                    for (r, acc_r) in acc.iter_mut().enumerate() {
                        let xv = _mm512_set1_ps(*xp.add(r * k + b * BLOCK + i));
                        for (acc_g, &w_g) in acc_r.iter_mut().zip(&w) {
                            *acc_g = _mm512_fmadd_ps(xv, w_g, *acc_g);
                        }
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (g, &v) in acc_r.iter().enumerate() {
                    _mm512_mask_storeu_ps(out.add(r * n + (p + g) * PANEL_WIDTH), masks[g], v);
                }
            }
        }
    }

    /// [`panels_avx512`] eight features a vector (two per panel).
    ///
    /// # Safety
    /// AVX2, FMA and F16C; as [`super::few_rows`].
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn panels_avx2<const G: usize, const R: usize>(a: &Args<'_>, p: usize) {
        let Args {
            bf16,
            x,
            data,
            nb,
            k,
            n,
            bias,
            out,
        } = *a;
        // SAFETY: the caller's contract bounds every load below; stores go through a buffer
        // clipped to n
        unsafe {
            let start: [[__m256; 2]; G] = std::array::from_fn(|g| {
                let mut lanes = [0f32; PANEL_WIDTH];
                let col0 = (p + g) * PANEL_WIDTH;
                let cols = n.saturating_sub(col0).min(PANEL_WIDTH);
                if !bias.is_empty() {
                    lanes[..cols].copy_from_slice(&bias[col0..col0 + cols]);
                }
                [
                    _mm256_loadu_ps(lanes.as_ptr()),
                    _mm256_loadu_ps(lanes.as_ptr().add(8)),
                ]
            });
            let mut acc = [start; R];
            let (base, xp) = (data.as_ptr(), x.as_ptr());
            for b in 0..nb {
                if b + PREFETCH_RECORDS < nb {
                    prefetch_records::<G>(base, nb, p, b + PREFETCH_RECORDS);
                }
                for i in 0..BLOCK {
                    let w: [[__m256; 2]; G] = std::array::from_fn(|g| {
                        let at = base.add(((p + g) * nb + b) * RECORD + 2 * PANEL_WIDTH * i);
                        std::array::from_fn(|h| {
                            widen8(bf16, _mm_loadu_si128(at.add(16 * h).cast()))
                        })
                    });
                    for (r, acc_r) in acc.iter_mut().enumerate() {
                        let xv = _mm256_set1_ps(*xp.add(r * k + b * BLOCK + i));
                        for (acc_g, w_g) in acc_r.iter_mut().zip(&w) {
                            for (acc_h, &w_h) in acc_g.iter_mut().zip(w_g) {
                                *acc_h = _mm256_fmadd_ps(xv, w_h, *acc_h);
                            }
                        }
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (g, acc_g) in acc_r.iter().enumerate() {
                    let mut lanes = [0f32; PANEL_WIDTH];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), acc_g[0]);
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc_g[1]);
                    let col0 = (p + g) * PANEL_WIDTH;
                    let cols = n.saturating_sub(col0).min(PANEL_WIDTH);
                    std::ptr::copy_nonoverlapping(lanes.as_ptr(), out.add(r * n + col0), cols);
                }
            }
        }
    }

    /// [`super::unpack_portable`], sixteen values a vector.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn unpack_avx512(format: PanelFormat, rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: 32 loads of 32 bytes inside the 1,024-byte record, 32 stores of 16 floats
        // inside `out`'s 512.
        unsafe {
            for i in 0..BLOCK {
                let halves = _mm256_loadu_si256(r.add(32 * i).cast());
                let w = widen16(format == PanelFormat::Bf16, halves);
                _mm512_storeu_ps(o.add(PANEL_WIDTH * i), w);
            }
        }
    }

    /// [`super::unpack_portable`], eight values a vector.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) unsafe fn unpack_avx2(format: PanelFormat, rec: &[u8], out: &mut [f32]) {
        assert!(rec.len() == RECORD && out.len() == BLOCK * PANEL_WIDTH);
        let (r, o) = (rec.as_ptr(), out.as_mut_ptr());
        // SAFETY: 64 loads of 16 bytes inside the record, 64 stores of 8 floats inside `out`.
        unsafe {
            for i in 0..2 * BLOCK {
                let halves = _mm_loadu_si128(r.add(16 * i).cast());
                let w = widen8(format == PanelFormat::Bf16, halves);
                _mm256_storeu_ps(o.add(8 * i), w);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    fn rounded(rng: &mut Lcg, len: usize, format: PanelFormat) -> Vec<f32> {
        (0..len)
            .map(|_| {
                let v = (rng.next_f32() - 0.5) * 0.2;
                match format {
                    PanelFormat::Bf16 => half::bf16::from_f32(v).to_f32(),
                    _ => f16::from_f32(v).to_f32(),
                }
            })
            .collect()
    }

    #[test]
    fn formats_are_named_only_where_they_hold_every_value() {
        let mut rng = Lcg(3);
        let bf = rounded(&mut rng, 1000, PanelFormat::Bf16);
        assert_eq!(format_of(&bf), Some(PanelFormat::Bf16));
        // float16 values with more than 8 significant bits: not bfloat16, float16
        let h = rounded(&mut rng, 1000, PanelFormat::F16);
        assert_eq!(format_of(&h), Some(PanelFormat::F16));
        // zeros of both signs, infinities: bfloat16 holds them
        assert_eq!(
            format_of(&[0.0, -0.0, f32::INFINITY, -1.5]),
            Some(PanelFormat::Bf16)
        );
        // one value neither holds
        let mut off = h.clone();
        off[10] = 0.1;
        assert_eq!(format_of(&off), None);
        // past float16's range: bfloat16 only, or neither
        assert_eq!(format_of(&[1e30]), None);
        assert_eq!(format_of(&[65536.0 * 4.0]), Some(PanelFormat::Bf16));
        let e = pack_into(&off[..64], 2, 32, PanelFormat::F16, &mut vec![0; RECORD]).unwrap_err();
        assert!(e.0.contains("not exactly"), "{}", e.0);
        let e = pack_into(&h[..64], 2, 32, PanelFormat::Q8_0, &mut vec![0; RECORD]).unwrap_err();
        assert!(e.0.contains("bf16 or f16"), "{}", e.0);
        assert!(packed_len(3, 48).is_err() && packed_len(0, 32).is_err());
        let e = pack_into(&h[..60], 2, 32, PanelFormat::F16, &mut vec![0; RECORD]).unwrap_err();
        assert!(e.0.contains("weight has 60"), "{}", e.0);
    }

    /// Every value unpacks to the weight it was packed from, on every unpacker, in the
    /// record order `cpu_quant_panels` expects (input-major, features past `n` zero).
    #[test]
    fn records_unpack_to_the_weights_bit_for_bit() {
        let mut rng = Lcg(8);
        for format in [PanelFormat::Bf16, PanelFormat::F16] {
            for &(n, k) in &[(16, 32), (21, 96), (3, 64)] {
                let w = rounded(&mut rng, n * k, format);
                let mut data = vec![0u8; packed_len(n, k).unwrap()];
                pack_into(&w, n, k, format, &mut data).unwrap();
                for (r, rec) in data.chunks_exact(RECORD).enumerate() {
                    let (p, b) = (r / (k / BLOCK), r % (k / BLOCK));
                    let mut outs = vec![vec![f32::NAN; BLOCK * PANEL_WIDTH]];
                    unpack_portable(format, rec, &mut outs[0]);
                    #[cfg(target_arch = "x86_64")]
                    {
                        use crate::cpu_isa::Isa;
                        if Isa::detect(Isa::Avx2) >= Isa::Avx2 {
                            let mut o = vec![f32::NAN; BLOCK * PANEL_WIDTH];
                            // SAFETY: the CPU has AVX2 and F16C
                            unsafe { x86::unpack_avx2(format, rec, &mut o) };
                            outs.push(o);
                        }
                        if Isa::detect(Isa::Avx512) >= Isa::Avx512 {
                            let mut o = vec![f32::NAN; BLOCK * PANEL_WIDTH];
                            // SAFETY: the CPU has AVX-512F
                            unsafe { x86::unpack_avx512(format, rec, &mut o) };
                            outs.push(o);
                        }
                    }
                    for out in &outs {
                        for i in 0..BLOCK {
                            for c in 0..PANEL_WIDTH {
                                let j = p * PANEL_WIDTH + c;
                                let want = if j < n { w[j * k + b * BLOCK + i] } else { 0.0 };
                                assert_eq!(out[i * PANEL_WIDTH + c].to_bits(), want.to_bits());
                            }
                        }
                    }
                }
            }
        }
    }
}
