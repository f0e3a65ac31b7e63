//! Steps of many rows through bfloat16 16-bit panels (`cpu_half_panels`) on Intel AMX tiles
//! (`TDPBF16PS`), at float32 accuracy: the weights are bfloat16 values (a bfloat16
//! checkpoint's), so only the activations need splitting. Each float32 of `x` is the exact sum
//! of three bfloat16 parts (`cpu_amx_tiles::split3`), each part times a bfloat16 weight is
//! exact in float32, so `x . w` is the sum of three tile products of exact terms: a float32
//! dot product summed in another order (no bit-for-bit promise with `linear_f32`; the same
//! accuracy). Float16 panels (a GGUF's F16 tensors) stay on the vector kernels: AMX-BF16 has no
//! float16 products.
//!
//! Work: `x` `[M, K]` is split once per call into its three bfloat16 parts, laid out as the A
//! tiles they are loaded as (per 16 rows, per 32 inputs, per part, 1 KiB one after the other:
//! contiguous loads, ~1.2-1.5x the row-major parts' speed on one thread; the rows past `M`
//! zero), over the kernels' pool. The output's
//! panels are then cut into one range per task (`cpu_linear::on_panel_ranges`); a task takes
//! its panels four at a time (a group of 64 features; a last group of fewer reads zero
//! weights for the rest, whose outputs are dropped): the group's records are rearranged once
//! into `TDPBF16PS`'s B operand (`[16 input pairs][16 features][2]` per 32 inputs, 1 KiB a
//! tile, [`b_tiles`]), then each tile of 16 rows accumulates its 16 x 64 outputs in tmm0-3 over
//! the inputs, 32 at a time: the three parts of its `x` rows (tmm4-6) times each of the four B
//! tiles (tmm7), twelve tile products per 32 inputs. The accumulators are stored, the bias
//! added and the rows below `M` written out.
//!
//! Invariants: reached only where `Isa::detect` gives `Isa::Amx` (AMX-TILE, AMX-BF16,
//! AVX-512F and -BW, the tile state granted); the caller (`cpu_quant_panels`) validated every
//! length (`QuantPanelShape::validate`: `K % 32 == 0`, the panels' bytes, `x`, `bias`, `out`);
//! every tile load reads inside a buffer sized here for it; tasks write disjoint columns of
//! `out` (their panel ranges); each task loads a tile configuration and releases the tiles
//! before it returns.

#[cfg(target_arch = "x86_64")]
use crate::cpu_amx_tiles::{
    aligned_64, release, split3_16, tile_dp, tile_load, tile_store, tile_zero, Shared, TileConfig,
};
#[cfg(target_arch = "x86_64")]
use crate::cpu_half_panels::RECORD;
#[cfg(target_arch = "x86_64")]
use crate::cpu_linear::{on_panel_ranges, LinearShape, OutPtr, PANEL_WIDTH};
#[cfg(target_arch = "x86_64")]
use crate::cpu_quant_linear::BLOCK;

/// The fewest rows a step sends here (fewer go to `cpu_half_panels::few_rows` or the walk).
/// Measured on a 2-core Xeon, SmolLM2's layers saved in bfloat16, both paths in one process
/// (`benches/half_panels.py --rows ...`, session 52): see the README's 16-bit panels section.
pub const MIN_ROWS: usize = 16;

/// Rows per tile, and panels (of 16 features) per group.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 16;
#[cfg(target_arch = "x86_64")]
const GROUP: usize = 4;
/// `u16` per tile (16 rows of 64 bytes).
#[cfg(target_arch = "x86_64")]
const TILE: usize = 512;

/// `out[M, N] = x[M, K] @ W^T + bias` from bfloat16 panels `data` (`cpu_half_panels`' records),
/// on up to `num_threads` tasks of the kernels' pool.
///
/// # Safety
/// `Isa::detect` gave `Isa::Amx`; the shapes and lengths passed `QuantPanelShape::validate`
/// (`x` `m * k`, `data` every record of `ceil(n / 16)` panels, `bias` empty or `n`, `out`
/// `m * n`), `m >= 1`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run(
    (m, n, k): (usize, usize, usize),
    x: &[f32],
    data: &[u8],
    bias: &[f32],
    out: &mut [f32],
    num_threads: usize,
) {
    let m16 = m.next_multiple_of(ROWS);
    let mut buffer = vec![0u16; 3 * m16 * k + 32];
    let parts = aligned_64(&mut buffer, 3 * m16 * k);
    // SAFETY: the caller's CPU and lengths; `parts` holds 3 * m16 * k.
    unsafe { split_rows(x, m, k, parts, num_threads) };
    let parts: &[u16] = parts;
    let out = OutPtr(out.as_mut_ptr());
    let shape = LinearShape { m, n, k };
    on_panel_ranges(&shape, num_threads, &|first, last| {
        // SAFETY: the caller's CPU and lengths; this range's columns are this task's alone.
        unsafe { run_panels((m, n, k), parts, data, bias, &out, first, last) };
    });
}

/// `x`'s rows as three bfloat16 parts, laid out as A tiles one after the other: per tile of 16
/// rows, per 32 inputs, per part, `[16 rows][32 inputs]` (1 KiB); the rows past `m` zero (row
/// tiles pulled by the pool's tasks).
///
/// # Safety
/// AVX-512F; `x.len() == m * k`, `k % 16 == 0`, `parts.len() == 3 * m.next_multiple_of(16) * k`.
#[cfg(target_arch = "x86_64")]
unsafe fn split_rows(x: &[f32], m: usize, k: usize, parts: &mut [u16], num_threads: usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let m16 = m.next_multiple_of(ROWS);
    assert!(x.len() == m * k && k.is_multiple_of(16) && parts.len() == 3 * m16 * k);
    let dst = Shared(parts.as_mut_ptr());
    let next = AtomicUsize::new(0);
    let tiles = m16 / ROWS;
    let job = |_| loop {
        let t = next.fetch_add(1, Ordering::Relaxed);
        if t >= tiles {
            break;
        }
        // SAFETY: the caller's CPU and lengths; row tiles are disjoint between tasks.
        unsafe { split_tile(x, m, k, dst, t) };
    };
    let tasks = num_threads.clamp(1, tiles).min(1 + m * k / (1 << 16));
    crate::cpu_prefill_attention::on_tasks(tasks, &job);
}

/// Row tile `t` of [`split_rows`].
///
/// # Safety
/// As [`split_rows`]; no other task writes tile `t`'s rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn split_tile(x: &[f32], m: usize, k: usize, dst: Shared<u16>, t: usize) {
    use std::arch::x86_64::*;
    let nb = k / BLOCK;
    for row in t * ROWS..((t + 1) * ROWS).min(m) {
        for c in (0..k).step_by(16) {
            let (kb, half) = (c / BLOCK, c % BLOCK);
            // SAFETY: inside `x` (row < m, c + 16 <= k) and the parts (tile t of m16 / 16).
            unsafe {
                let v = _mm512_loadu_ps(x.as_ptr().add(row * k + c));
                for (p, part) in split3_16(v).into_iter().enumerate() {
                    let tile = (t * nb + kb) * 3 + p;
                    let at = dst.get().add(tile * TILE + (row % ROWS) * BLOCK + half);
                    _mm256_storeu_si256(at.cast(), part);
                }
            }
        }
    }
}

/// The B operands of panels `first..first + GROUP` (those past `last` zero): per panel, per 32
/// inputs, a tile `[16 input pairs][16 features][2 inputs]` rearranged from its record
/// `[32 inputs][16 features]`.
///
/// # Safety
/// AVX-512F and -BW; `data` holds panels `first..last` (`k / 32` records each), `tiles` holds
/// `GROUP * k / 32 * TILE`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn b_tiles(data: &[u8], k: usize, first: usize, last: usize, tiles: &mut [u16]) {
    use std::arch::x86_64::*;
    let nb = k / BLOCK;
    assert!(tiles.len() == GROUP * nb * TILE && data.len() >= last * nb * RECORD);
    // lane 2j <- row 2r's feature j, lane 2j + 1 <- row 2r + 1's (the second half of the pair)
    let idx: [u16; 32] = std::array::from_fn(|i| (i / 2 + (i % 2) * 16) as u16);
    // SAFETY: `idx` holds 32 u16.
    let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
    for (j, group_tiles) in tiles.chunks_exact_mut(nb * TILE).enumerate() {
        let panel = first + j;
        if panel >= last {
            group_tiles.fill(0);
            continue;
        }
        for (b, tile) in group_tiles.chunks_exact_mut(TILE).enumerate() {
            let record = &data[(panel * nb + b) * RECORD..][..RECORD];
            for r in 0..16 {
                // SAFETY: rows 2r and 2r + 1 of the record (64 bytes from 64 r), and row r of
                // the tile (32 u16 from 32 r), are inside their slices.
                unsafe {
                    let pair = _mm512_loadu_si512(record.as_ptr().add(64 * r).cast());
                    let v = _mm512_permutexvar_epi16(idx, pair);
                    _mm512_storeu_si512(tile.as_mut_ptr().add(32 * r).cast(), v);
                }
            }
        }
    }
}

/// Output columns of panels `first..last` (module header).
///
/// # Safety
/// As [`run`]; no other task writes those columns of `out`; `parts` as [`split_rows`] wrote it.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_panels(
    (m, n, k): (usize, usize, usize),
    parts: &[u16],
    data: &[u8],
    bias: &[f32],
    out: &OutPtr,
    first: usize,
    last: usize,
) {
    if first >= last {
        return;
    }
    let nb = k / BLOCK;
    let m16 = m.next_multiple_of(ROWS);
    let mut buffer = vec![0u16; GROUP * nb * TILE + 32];
    let tiles = aligned_64(&mut buffer, GROUP * nb * TILE);
    let mut c = [[0f32; ROWS * PANEL_WIDTH]; GROUP];
    let config = TileConfig::new(&[16; 8]);
    // SAFETY: Isa::Amx (the caller's contract).
    unsafe { config.load() };
    let mut panel = first;
    while panel < last {
        // SAFETY: the caller's CPU; `data` holds panels first..last; `tiles` was sized here.
        unsafe { b_tiles(data, k, panel, last, tiles) };
        let b = tiles.as_ptr();
        for row0 in (0..m16).step_by(ROWS) {
            // SAFETY: every load reads 16 rows of 64 bytes: the A operands from rows row0..+16
            // of each part (inside `parts`: row0 + 16 <= m16), the B operands from `tiles`
            // (GROUP * nb tiles); the stores write 16 rows of 64 bytes into `c`'s arrays of
            // 256 floats. The tiles are configured (16 rows x 64 bytes each).
            unsafe {
                tile_zero!("tmm0");
                tile_zero!("tmm1");
                tile_zero!("tmm2");
                tile_zero!("tmm3");
                for kb in 0..nb {
                    let a = parts.as_ptr().add(((row0 / ROWS) * nb + kb) * 3 * TILE);
                    tile_load!("tmm4", a, 64usize);
                    tile_load!("tmm5", a.add(TILE), 64usize);
                    tile_load!("tmm6", a.add(2 * TILE), 64usize);
                    tile_load!("tmm7", b.add(kb * TILE), 64usize);
                    tile_dp!("tmm0", "tmm4", "tmm7");
                    tile_dp!("tmm0", "tmm5", "tmm7");
                    tile_dp!("tmm0", "tmm6", "tmm7");
                    tile_load!("tmm7", b.add((nb + kb) * TILE), 64usize);
                    tile_dp!("tmm1", "tmm4", "tmm7");
                    tile_dp!("tmm1", "tmm5", "tmm7");
                    tile_dp!("tmm1", "tmm6", "tmm7");
                    tile_load!("tmm7", b.add((2 * nb + kb) * TILE), 64usize);
                    tile_dp!("tmm2", "tmm4", "tmm7");
                    tile_dp!("tmm2", "tmm5", "tmm7");
                    tile_dp!("tmm2", "tmm6", "tmm7");
                    tile_load!("tmm7", b.add((3 * nb + kb) * TILE), 64usize);
                    tile_dp!("tmm3", "tmm4", "tmm7");
                    tile_dp!("tmm3", "tmm5", "tmm7");
                    tile_dp!("tmm3", "tmm6", "tmm7");
                }
                tile_store!("tmm0", c[0].as_mut_ptr(), 64usize);
                tile_store!("tmm1", c[1].as_mut_ptr(), 64usize);
                tile_store!("tmm2", c[2].as_mut_ptr(), 64usize);
                tile_store!("tmm3", c[3].as_mut_ptr(), 64usize);
            }
            for (j, cj) in c.iter().enumerate() {
                let col0 = (panel + j) * PANEL_WIDTH;
                if panel + j >= last || col0 >= n {
                    break;
                }
                let cols = (n - col0).min(PANEL_WIDTH);
                for r in 0..ROWS.min(m - row0.min(m)) {
                    let row = row0 + r;
                    for col in 0..cols {
                        let b = if bias.is_empty() {
                            0.0
                        } else {
                            bias[col0 + col]
                        };
                        // SAFETY: row < m, col0 + col < n: inside `out` (m * n); these
                        // columns are this task's alone.
                        unsafe { *out.0.add(row * n + col0 + col) = cj[r * PANEL_WIDTH + col] + b };
                    }
                }
            }
        }
        panel += GROUP;
    }
    // SAFETY: this task configured the tiles above.
    unsafe { release() };
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::cpu_half_panels::pack_into;
    use crate::test_rng::Lcg;

    fn bf16_round(v: f32) -> f32 {
        f32::from_bits(v.to_bits() & 0xFFFF_0000)
    }

    /// Against an f64 reference of the same bfloat16 weights, several shapes (panels not a
    /// multiple of the group, features not of 16, rows not of 16), 1-3 threads.
    #[test]
    #[ignore = "needs AMX: run with --include-ignored where the CPU has it"]
    fn amx_bf16_matches_an_f64_reference() {
        if !crate::cpu_amx_linear::available() {
            eprintln!("AMX not available here");
            return;
        }
        let mut rng = Lcg(77);
        for &(m, n, k) in &[
            (32, 64, 64),
            (37, 72, 96),
            (100, 200, 576),
            (16, 16, 32),
            (65, 130, 1536),
        ] {
            let w: Vec<f32> = rng.vec(n * k).into_iter().map(bf16_round).collect();
            let x: Vec<f32> = rng.vec(m * k).iter().map(|v| v * 3.0).collect();
            let bias: Vec<f32> = rng.vec(n);
            let mut data = vec![0u8; crate::cpu_half_panels::packed_len(n, k).unwrap()];
            pack_into(
                &w,
                n,
                k,
                crate::cpu_quant_panels::PanelFormat::Bf16,
                &mut data,
            )
            .unwrap();
            for threads in [1, 2, 3] {
                for with_bias in [false, true] {
                    let b: &[f32] = if with_bias { &bias } else { &[] };
                    let mut out = vec![f32::NAN; m * n];
                    // SAFETY: AMX available (checked); the lengths are the packed shapes'.
                    unsafe { run((m, n, k), &x, &data, b, &mut out, threads) };
                    for r in 0..m {
                        for c in 0..n {
                            let want: f64 = (0..k)
                                .map(|i| x[r * k + i] as f64 * w[c * k + i] as f64)
                                .sum::<f64>()
                                + if with_bias { bias[c] as f64 } else { 0.0 };
                            let scale: f64 = (0..k)
                                .map(|i| (x[r * k + i] as f64 * w[c * k + i] as f64).abs())
                                .sum();
                            let got = out[r * n + c] as f64;
                            assert!(
                                (got - want).abs() <= 1e-6 * scale + 1e-6,
                                "{m}x{n}x{k} threads {threads} [{r}, {c}]: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
