//! Criterion-free driver for instruction counting (`valgrind --tool=callgrind`): builds the
//! `schedule_cycle` bench's steady state with R running (arg 1, default 256) and 4096 waiting,
//! then runs N cycles (arg 2, default 200). Compare Ir of N=200 vs N=0 for Ir per cycle.

#[path = "../benches/support/cycle_state.rs"]
mod cycle_state;
use cycle_state::Bench;

fn main() {
    let mut args = std::env::args().skip(1);
    let running: usize = args.next().map_or(256, |a| a.parse().unwrap());
    let cycles: usize = args.next().map_or(200, |a| a.parse().unwrap());
    let mut b = Bench::new(running);
    let mut tokens = 0usize;
    for _ in 0..cycles {
        b.cycle(true);
        tokens += b.s.batch().num_tokens();
    }
    println!("running={running} cycles={cycles} tokens={tokens}");
}
