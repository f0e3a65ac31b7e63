//! The AMX linear kernel alone (`cpu_amx_linear::linear_amx_f32`), on SmolLM2's layer shapes:
//! a decode step's 30 x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) linears over
//! random Q8_0 (or Q4_1) blocks, best of 20, in ms per step and ns per 16 x 32 chunk.
//!
//!     cargo run --release --example amx_linears -- ROWS [THREADS] [q4]
//!
//! Needs a CPU with AMX (the call errors otherwise). No Python: quick to rebuild while a kernel
//! changes (session 44 timed its variants with it; whole steps are `benches/build_ab.py`'s).

use rust_scheduler::cpu_amx_linear::*;
use rust_scheduler::cpu_quant_linear::QuantWeight;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let m: usize = args.get(1).map_or(16, |s| s.parse().unwrap());
    let threads: usize = args.get(2).map_or(1, |s| s.parse().unwrap());
    let q4 = args.get(3).is_some_and(|s| s == "q4");
    // SmolLM2-135M per layer: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536
    let shapes = [(960usize, 576usize), (576, 576), (3072, 576), (576, 1536)];
    let mut packed = Vec::new();
    let mut seed = 12345u64;
    let mut rnd = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    for &(n, k) in &shapes {
        let nb = n * k / 32;
        let scale: Vec<f32> = (0..nb)
            .map(|_| (rnd() % 1000) as f32 * 1e-5 + 1e-4)
            .collect();
        let min: Vec<f32> = (0..nb).map(|_| -((rnd() % 1000) as f32) * 1e-5).collect();
        let qs8: Vec<i8> = (0..n * k).map(|_| rnd() as i8).collect();
        let qs4: Vec<u8> = (0..n * k / 2).map(|_| rnd() as u8).collect();
        let w = if q4 {
            QuantWeight::Q4_1 {
                scale: &scale,
                min: &min,
                qs: &qs4,
            }
        } else {
            QuantWeight::Q8_0 {
                scale: &scale,
                qs: &qs8,
            }
        };
        let fmt = AmxFormat::of(&w).unwrap();
        let data = pack(&w, n, k).unwrap();
        packed.push((n, k, fmt, data));
    }
    let x: Vec<f32> = (0..m * 1536)
        .map(|_| (rnd() % 2000) as f32 * 1e-3 - 1.0)
        .collect();
    let mut out = vec![0f32; m * 3072];
    let layers = 30;
    let reps = 20;
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        for _ in 0..layers {
            for (n, k, fmt, data) in &packed {
                let shape = AmxShape { m, n: *n, k: *k };
                linear_amx_f32(
                    &shape,
                    &x[..m * k],
                    AmxTiles { format: *fmt, data },
                    &[],
                    &mut out[..m * n],
                    threads,
                )
                .unwrap();
            }
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let chunks: usize = packed.iter().map(|(n, k, _, _)| n * k / 512).sum::<usize>() * layers;
    println!("m={m} threads={threads} q4={q4}: {:.2} ms per step's linears, {:.1} ns per chunk (x threads: {:.1})", best * 1e3, best * 1e9 / chunks as f64, best * 1e9 * threads as f64 / chunks as f64);
}
