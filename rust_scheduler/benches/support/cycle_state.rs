//! The steady state shared by the criterion bench (`benches/schedule_cycle.rs`) and the
//! criterion-free callgrind driver (`examples/cycle_driver.rs`): R running sequences (mostly
//! decodes) and 4096 waiting; every finished request is resubmitted through the intake.

use rust_scheduler::{NewRequest, Scheduler, SchedulerConfig};

pub const WAITING: usize = 4096;

pub struct Bench {
    pub s: Scheduler,
    next_id: u64,
    sampled: Vec<i32>,
}

impl Bench {
    pub fn new(running: usize) -> Self {
        let cfg = SchedulerConfig {
            num_blocks: running * 14 + 256,
            block_size: 16,
            max_num_seqs: running,
            max_num_batched_tokens: 2048.max(running + 256),
            max_model_len: 4096,
            vocab_size: 32000,
            eos_token_ids: vec![2],
            intake_capacity: 8192,
            ..SchedulerConfig::default()
        };
        let mut b = Bench {
            s: Scheduler::new(cfg).unwrap(),
            next_id: 0,
            sampled: Vec::new(),
        };
        for _ in 0..running {
            b.submit();
        }
        // Fill the running set, then queue the waiting ones.
        while b.s.stats().num_running < running || b.s.stats().num_waiting > 0 {
            b.cycle(false);
        }
        for _ in 0..WAITING {
            b.submit();
        }
        b.cycle(true);
        assert_eq!(b.s.stats().num_running, running);
        b
    }

    fn submit(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let h = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let prompt: Vec<i32> = (0..32)
            .map(|k| ((h >> (k % 48)) as i32 & 0x3fff) + 3)
            .collect();
        let mut r = NewRequest::new(id, prompt, 64 + (h % 128) as usize);
        r.ignore_eos = true;
        self.s.submit(r).unwrap();
    }

    pub fn cycle(&mut self, resubmit: bool) {
        let n = self.s.schedule().unwrap().num_samples();
        self.sampled.clear();
        self.sampled.extend((0..n).map(|i| 100 + i as i32));
        let done = self
            .s
            .update(&self.sampled)
            .unwrap()
            .finish_reasons
            .iter()
            .filter(|&&r| r != 0)
            .count();
        if resubmit {
            for _ in 0..done {
                self.submit();
            }
        }
    }
}
