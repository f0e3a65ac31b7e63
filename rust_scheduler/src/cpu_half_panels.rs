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
//! Invariants: [`format_of`] names a format only if every weight comes back from it bit for bit
//! (checked value by value, before anything is packed); [`pack_into`] checks the weight's and
//! the output's lengths before writing; the unpackers read exactly one record and write
//! exactly 512 floats.

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

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{BLOCK, PANEL_WIDTH, RECORD};
    use crate::cpu_quant_panels::PanelFormat;
    use std::arch::x86_64::*;

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
                let w = match format {
                    // a bfloat16 is a float32's high half
                    PanelFormat::Bf16 => {
                        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
                    }
                    _ => _mm512_cvtph_ps(halves),
                };
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
                let w = match format {
                    PanelFormat::Bf16 => {
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
                    }
                    _ => _mm256_cvtph_ps(halves),
                };
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
