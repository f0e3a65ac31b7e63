//! LoRA updates inside the fused CPU step (`cpu_decoder`): after a linear layer, each adapter
//! row adds its adapter's low-rank update, `out[i] += (x[i] @ A_b^T) @ B_b^T`, `b` the row's
//! block of the engine's stacked adapters (`runtime/lora.py`'s `StackedLora`).
//!
//! Layout, per linear layer: `a` `[blocks * width, k]` (adapter `b`'s A rows in rows
//! `b * width ..`, zero rows past its rank), `b_t` `[blocks * width, n]` (its B transposed, the
//! same rows). A row's block is `row_blocks[i]`; a negative block is a base-model row, left as
//! the linear layer wrote it.
//!
//! Invariants (checked by [`LoraWeights::check`] and [`check_row_blocks`] before anything is
//! written): `a.len() == blocks * width * k`, `b_t.len() == blocks * width * n`, every
//! `row_blocks[i] < blocks`. Rows are split over the threads when there is enough work; each
//! thread writes only its own rows of `out`.

use crate::cpu_error::KernelInputError;
use crate::cpu_isa::Isa;
use crate::cpu_linear::OutPtr;

/// One linear layer's stacked adapters (module header).
#[derive(Clone, Copy)]
pub struct LoraWeights<'a> {
    pub a: &'a [f32],
    pub b_t: &'a [f32],
    /// rows per block (the largest rank of the adapters of this module)
    pub width: usize,
    /// `[blocks * width, 2]`: the columns `lo..hi` outside which row `j` of `b_t` is zero (a
    /// fused module's B is block-diagonal: q / k / v, gate / up), `lo == hi` for a zero row
    /// (a rank below `width`); empty: every row spans every column
    pub b_cols: &'a [i32],
}

/// One decoder layer's updates: qkv, o_proj, gate_up, down (None where no adapter adapts it).
pub type LoraLayer<'a> = [Option<LoraWeights<'a>>; 4];

/// A step's LoRA updates: every layer's weights and each row's block.
#[derive(Clone, Copy)]
pub struct StepLora<'a> {
    pub layers: &'a [LoraLayer<'a>],
    /// `[R]`: the block of each row of the step, negative for base-model rows
    pub row_blocks: &'a [i32],
}

/// Work (multiply-adds) below which the update runs on the calling thread.
const SERIAL_WORK: usize = 1 << 16;

impl LoraWeights<'_> {
    /// The number of blocks, after checking the arrays against a `[n, k]` linear layer.
    pub fn check(&self, name: &str, n: usize, k: usize) -> Result<usize, KernelInputError> {
        let bad = |m: String| Err(KernelInputError(format!("{name} LoRA: {m}")));
        if self.width == 0 || k == 0 || !self.a.len().is_multiple_of(self.width * k) {
            return bad(format!(
                "A has {} elements, not a multiple of width {} x k {k}",
                self.a.len(),
                self.width
            ));
        }
        let blocks = self.a.len() / (self.width * k);
        if self.b_t.len() != blocks * self.width * n {
            return bad(format!(
                "B has {} elements, not {blocks} blocks x width {} x n {n}",
                self.b_t.len(),
                self.width
            ));
        }
        if !self.b_cols.is_empty() {
            if self.b_cols.len() != 2 * blocks * self.width {
                return bad(format!(
                    "B's column ranges have {} entries, not 2 x {} rows",
                    self.b_cols.len(),
                    blocks * self.width
                ));
            }
            if let Some(r) = self
                .b_cols
                .chunks_exact(2)
                .find(|r| r[0] < 0 || r[0] > r[1] || r[1] as usize > n)
            {
                return bad(format!(
                    "B column range {}..{} not within 0..{n}",
                    r[0], r[1]
                ));
            }
        }
        Ok(blocks)
    }
}

/// `row_blocks` has one entry per row, each below `blocks` (or negative).
pub fn check_row_blocks(
    row_blocks: &[i32],
    rows: usize,
    blocks: usize,
) -> Result<(), KernelInputError> {
    if row_blocks.len() != rows {
        return Err(KernelInputError(format!(
            "LoRA row blocks: {} entries for {rows} rows",
            row_blocks.len()
        )));
    }
    match row_blocks.iter().find(|&&b| b >= 0 && b as usize >= blocks) {
        Some(b) => Err(KernelInputError(format!(
            "LoRA row block {b} out of range of {blocks} blocks"
        ))),
        None => Ok(()),
    }
}

/// `out[i, :n] += (x[i, :k] @ A_b^T) @ B_b^T` for every row `i` whose block `b` is not
/// negative. The arrays passed [`LoraWeights::check`] and [`check_row_blocks`]; `x` is
/// `[rows, k]`, `out` `[rows, n]`.
pub fn add_lora_rows(
    w: &LoraWeights<'_>,
    k: usize,
    n: usize,
    row_blocks: &[i32],
    x: &[f32],
    out: &mut [f32],
    threads: usize,
) {
    let rows = row_blocks.len();
    assert!(x.len() >= rows * k && out.len() >= rows * n);
    let adapted = row_blocks.iter().filter(|&&b| b >= 0).count();
    if adapted == 0 {
        return;
    }
    let work = adapted * w.width * (k + n);
    let threads = threads.clamp(1, adapted).min(1 + work / SERIAL_WORK);
    if threads == 1 {
        let mut xa = vec![0f32; w.width];
        for (i, &b) in row_blocks.iter().enumerate() {
            if b >= 0 {
                update_row(
                    w,
                    k,
                    n,
                    b as usize,
                    &x[i * k..][..k],
                    &mut out[i * n..][..n],
                    &mut xa,
                );
            }
        }
        return;
    }
    let pool = crate::cpu_pool::global(threads);
    let threads = threads.min(pool.max_tasks());
    let per_thread = rows.div_ceil(threads);
    let out_ptr = OutPtr(out.as_mut_ptr());
    pool.run(threads, &|t| {
        let (first, last) = ((t * per_thread).min(rows), ((t + 1) * per_thread).min(rows));
        let mut xa = vec![0f32; w.width];
        for (i, &b) in row_blocks.iter().enumerate().take(last).skip(first) {
            if b >= 0 {
                // SAFETY: `out` holds `rows * n` elements (asserted above) and outlives the
                // run; thread `t` writes only rows `first..last`, disjoint from the others'.
                let row = unsafe { std::slice::from_raw_parts_mut(row_start(&out_ptr, i * n), n) };
                update_row(w, k, n, b as usize, &x[i * k..][..k], row, &mut xa);
            }
        }
    });
}

/// `out + at` (a function, so that a closure captures the whole `OutPtr`, which is `Sync`).
///
/// # Safety
/// `at` is within the buffer `out` points to.
unsafe fn row_start(out: &OutPtr, at: usize) -> *mut f32 {
    out.0.add(at)
}

/// One row's update through block `b`; `xa` is scratch of `width` floats. The loops are
/// compiled for AVX-512 or AVX2 + FMA where the CPU has them (the same sums: fused
/// multiply-adds over 16 partial sums either way; AVX-512 measured 25.2 against AVX2's 28.9 us
/// for 16 rows of a 576 -> 960 module at width 24, session 38).
fn update_row(
    w: &LoraWeights<'_>,
    k: usize,
    n: usize,
    b: usize,
    x: &[f32],
    out: &mut [f32],
    xa: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    match Isa::detect(Isa::Avx512) {
        // SAFETY: this CPU has AVX-512F (and AVX2 and FMA), or AVX2 and FMA (detected here).
        Isa::Avx512 => return unsafe { update_row_avx512(w, k, n, b, x, out, xa) },
        Isa::Avx2 => return unsafe { update_row_avx2(w, k, n, b, x, out, xa) },
        _ => {}
    }
    update_row_body::<false>(w, k, n, b, x, out, xa);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn update_row_avx512(
    w: &LoraWeights<'_>,
    k: usize,
    n: usize,
    b: usize,
    x: &[f32],
    out: &mut [f32],
    xa: &mut [f32],
) {
    update_row_body::<true>(w, k, n, b, x, out, xa);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn update_row_avx2(
    w: &LoraWeights<'_>,
    k: usize,
    n: usize,
    b: usize,
    x: &[f32],
    out: &mut [f32],
    xa: &mut [f32],
) {
    update_row_body::<true>(w, k, n, b, x, out, xa);
}

#[inline(always)]
fn update_row_body<const FMA: bool>(
    w: &LoraWeights<'_>,
    k: usize,
    n: usize,
    b: usize,
    x: &[f32],
    out: &mut [f32],
    xa: &mut [f32],
) {
    let first = b * w.width;
    let cols = |j: usize| match w.b_cols {
        [] => (0, n),
        c => (c[2 * (first + j)] as usize, c[2 * (first + j) + 1] as usize),
    };
    for (j, v) in xa.iter_mut().enumerate() {
        let (lo, hi) = cols(j);
        *v = if lo < hi {
            dot::<FMA>(&w.a[(first + j) * k..][..k], x)
        } else {
            0.0 // B's row is zero: A's row is not needed
        };
    }
    // B rows with the same columns (a part of a fused module: q, k, v, gate, up) are added
    // together, a chunk of the output row at a time kept in registers across them
    let mut j = 0;
    while j < xa.len() {
        let (lo, hi) = cols(j);
        let mut end = j + 1;
        while end < xa.len() && cols(end) == (lo, hi) {
            end += 1;
        }
        if lo < hi {
            add_rows_of_b::<FMA>(&xa[j..end], &w.b_t[(first + j) * n..], n, lo, hi, out);
        }
        j = end;
    }
}

/// `out[lo..hi] += sum_j xa[j] * b[j * n + lo..hi]`, CHUNK columns at a time.
#[inline(always)]
fn add_rows_of_b<const FMA: bool>(
    xa: &[f32],
    b: &[f32],
    n: usize,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) {
    const CHUNK: usize = 32;
    let mut c = lo;
    while c + CHUNK <= hi {
        let mut acc: [f32; CHUNK] = out[c..c + CHUNK].try_into().expect("a chunk");
        for (j, &v) in xa.iter().enumerate() {
            let row = &b[j * n + c..][..CHUNK];
            for l in 0..CHUNK {
                acc[l] = madd::<FMA>(v, row[l], acc[l]);
            }
        }
        out[c..c + CHUNK].copy_from_slice(&acc);
        c += CHUNK;
    }
    for (j, &v) in xa.iter().enumerate() {
        let row = &b[j * n..];
        for col in c..hi {
            out[col] = madd::<FMA>(v, row[col], out[col]);
        }
    }
}

/// `a . b` with 16 partial sums (so the loop vectorizes), then their sum.
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] = madd::<FMA>(x[l], y[l], acc[l]);
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// `a * b + c`, fused where the caller's target has FMA.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Lcg;

    /// The update in float64, every row and block written out.
    fn reference(w: &LoraWeights<'_>, k: usize, n: usize, blocks: &[i32], x: &[f32]) -> Vec<f64> {
        let mut out = vec![0f64; blocks.len() * n];
        for (i, &b) in blocks.iter().enumerate() {
            if b < 0 {
                continue;
            }
            for j in 0..w.width {
                let row = b as usize * w.width + j;
                let xa: f64 = (0..k)
                    .map(|t| x[i * k + t] as f64 * w.a[row * k + t] as f64)
                    .sum();
                for c in 0..n {
                    out[i * n + c] += xa * w.b_t[row * n + c] as f64;
                }
            }
        }
        out
    }

    fn random(rng: &mut Lcg, len: usize) -> Vec<f32> {
        rng.vec(len)
    }

    #[test]
    fn rows_add_their_own_blocks_update_and_base_rows_stay() {
        let mut rng = Lcg(7);
        for &(rows, k, n, width, blocks, threads) in &[
            (1, 8, 12, 2, 1, 1),
            (5, 64, 96, 8, 3, 2),
            (300, 96, 160, 16, 4, 4), // enough work for several threads
            (37, 33, 17, 3, 2, 3),    // sizes that divide nothing
        ] {
            let (a, b_t) = (
                random(&mut rng, blocks * width * k),
                random(&mut rng, blocks * width * n),
            );
            let w = LoraWeights {
                a: &a,
                b_t: &b_t,
                width,
                b_cols: &[],
            };
            let row_blocks: Vec<i32> = (0..rows)
                .map(|i| ((i * 7 + rows) % (blocks + 1)) as i32 - 1)
                .collect();
            let x = random(&mut rng, rows * k);
            let before = random(&mut rng, rows * n);
            let mut out = before.clone();
            assert_eq!(w.check("t", n, k).unwrap(), blocks);
            check_row_blocks(&row_blocks, rows, blocks).unwrap();
            add_lora_rows(&w, k, n, &row_blocks, &x, &mut out, threads);
            let want = reference(&w, k, n, &row_blocks, &x);
            for i in 0..rows * n {
                let expect = before[i] as f64 + want[i];
                assert!(
                    (out[i] as f64 - expect).abs() <= 1e-4 * (1.0 + expect.abs()),
                    "row {} col {}: {} vs {expect}",
                    i / n,
                    i % n,
                    out[i]
                );
                if row_blocks[i / n] < 0 {
                    assert_eq!(out[i], before[i], "a base row changed");
                }
            }
        }
    }

    #[test]
    fn column_ranges_skip_only_zeros() {
        // B rows zero outside their ranges (and one zero row): the same update with and
        // without the ranges
        let mut rng = Lcg(11);
        let (rows, k, n, width, blocks) = (9, 40, 30, 3, 2);
        let a = random(&mut rng, blocks * width * k);
        let ranges = [(0, 10), (10, 20), (20, 30), (5, 25), (0, 0), (0, 30)];
        let mut b_t = random(&mut rng, blocks * width * n);
        let mut b_cols = vec![];
        for (j, &(lo, hi)) in ranges.iter().enumerate() {
            for c in 0..n {
                if c < lo || c >= hi {
                    b_t[j * n + c] = 0.0;
                }
            }
            b_cols.extend([lo as i32, hi as i32]);
        }
        let row_blocks: Vec<i32> = (0..rows).map(|i| (i % 3) as i32 - 1).collect();
        let x = random(&mut rng, rows * k);
        let full = LoraWeights {
            a: &a,
            b_t: &b_t,
            width,
            b_cols: &[],
        };
        let ranged = LoraWeights {
            b_cols: &b_cols,
            ..full
        };
        assert_eq!(ranged.check("t", n, k).unwrap(), blocks);
        let (mut want, mut got) = (vec![0f32; rows * n], vec![0f32; rows * n]);
        add_lora_rows(&full, k, n, &row_blocks, &x, &mut want, 1);
        add_lora_rows(&ranged, k, n, &row_blocks, &x, &mut got, 1);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
        }
        let bad = [0, 10, 10, 31, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(LoraWeights {
            b_cols: &bad,
            ..full
        }
        .check("t", n, k)
        .is_err());
        assert!(LoraWeights {
            b_cols: &b_cols[..4],
            ..full
        }
        .check("t", n, k)
        .is_err());
    }

    #[test]
    fn bad_shapes_and_blocks_are_errors() {
        let (a, b_t) = (vec![0f32; 2 * 4 * 8], vec![0f32; 2 * 4 * 6]);
        let w = LoraWeights {
            a: &a,
            b_t: &b_t,
            width: 4,
            b_cols: &[],
        };
        assert_eq!(w.check("t", 6, 8).unwrap(), 2);
        assert!(w.check("t", 7, 8).is_err());
        assert!(w.check("t", 6, 5).is_err());
        assert!(LoraWeights { width: 0, ..w }.check("t", 6, 8).is_err());
        assert!(check_row_blocks(&[0, 1, -1], 3, 2).is_ok());
        assert!(check_row_blocks(&[0, 2], 2, 2).is_err());
        assert!(check_row_blocks(&[0], 2, 2).is_err());
    }
}
