//! One `schedule()` + `update()` cycle in steady state with R running sequences and 4096
//! waiting: mostly decodes, plus the prefill chunks of requests admitted to replace finished
//! ones (which are resubmitted through the intake, so waiting stays at 4096).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use std::time::Duration;

#[path = "support/cycle_state.rs"]
mod cycle_state;
use cycle_state::Bench;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("schedule_update_cycle");
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1))
        .sample_size(30);
    for running in [64usize, 256, 1024] {
        let mut b = Bench::new(running);
        g.bench_with_input(BenchmarkId::new("running", running), &running, |bn, _| {
            bn.iter(|| {
                b.cycle(true);
                black_box(b.s.batch().num_tokens());
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
