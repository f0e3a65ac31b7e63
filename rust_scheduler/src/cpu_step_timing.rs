//! Opt-in wall-clock accounting of the fused CPU step's phases (`cpu_decoder::forward_step`):
//! how much of the steps the linear layers, attention and everything between them (norms,
//! RoPE, KV writes, SiLU, residual adds, buffers, checks) took, summed until read. It answers
//! "where does a step's time go" without a profiler (`benches/step_breakdown.py`).
//!
//! Off by default: a step then pays one relaxed atomic load and no clock reads. On, it reads
//! the clock at every phase boundary (9 per layer).
//!
//! Invariants: every nanosecond between a step's [`PhaseCounters::clock`] and its last
//! [`PhaseClock::lap`] is counted once, in exactly one phase; the totals only grow until
//! [`PhaseCounters::take`], which returns them and zeroes each counter atomically (a
//! concurrent step's lap lands in this read or the next, never in both or neither).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// The counters `forward_step` reports to.
pub static STEP_PHASES: PhaseCounters = PhaseCounters::new();

/// Where a lap's time goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// the decoder layers' linear projections (qkv, o, gate/up, down)
    Linear = 0,
    /// decode and prefill attention
    Attention = 1,
    /// everything else in the step
    Other = 2,
}

/// Totals per phase, and whether steps count at all.
pub struct PhaseCounters {
    enabled: AtomicBool,
    ns: [AtomicU64; 3],
    steps: AtomicU64,
}

/// Totals since the last [`PhaseCounters::take`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhaseTotals {
    pub linear_ns: u64,
    pub attention_ns: u64,
    pub other_ns: u64,
    pub steps: u64,
}

impl PhaseCounters {
    pub const fn new() -> PhaseCounters {
        PhaseCounters {
            enabled: AtomicBool::new(false),
            ns: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
            steps: AtomicU64::new(0),
        }
    }

    /// Turns the accounting on or off for steps that start afterwards.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Relaxed);
    }

    /// Totals since the last `take`, each counter then zeroed.
    pub fn take(&self) -> PhaseTotals {
        PhaseTotals {
            linear_ns: self.ns[Phase::Linear as usize].swap(0, Relaxed),
            attention_ns: self.ns[Phase::Attention as usize].swap(0, Relaxed),
            other_ns: self.ns[Phase::Other as usize].swap(0, Relaxed),
            steps: self.steps.swap(0, Relaxed),
        }
    }

    /// A clock for one step: a no-op unless the accounting is on now.
    pub fn clock(&self) -> PhaseClock<'_> {
        PhaseClock {
            counters: self,
            last: self.enabled.load(Relaxed).then(Instant::now),
        }
    }
}

impl Default for PhaseCounters {
    fn default() -> Self {
        PhaseCounters::new()
    }
}

/// One step's clock ([`PhaseCounters::clock`]).
pub struct PhaseClock<'a> {
    counters: &'a PhaseCounters,
    last: Option<Instant>,
}

impl PhaseClock<'_> {
    /// Counts the time since the previous lap (or the clock's start) as `phase`.
    #[inline]
    pub fn lap(&mut self, phase: Phase) {
        if let Some(last) = self.last {
            let now = Instant::now();
            let ns = u64::try_from((now - last).as_nanos()).unwrap_or(u64::MAX);
            self.counters.ns[phase as usize].fetch_add(ns, Relaxed);
            self.last = Some(now);
        }
    }

    /// Counts the step (its time is in the laps).
    pub fn finish(self) {
        if self.last.is_some() {
            self.counters.steps.fetch_add(1, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_land_in_their_phase_only_while_enabled() {
        let counters = PhaseCounters::new();
        let mut clock = counters.clock();
        std::thread::sleep(std::time::Duration::from_millis(2));
        clock.lap(Phase::Linear);
        clock.finish();
        assert_eq!(
            counters.take(),
            PhaseTotals::default(),
            "off: nothing counted"
        );

        counters.set_enabled(true);
        let t0 = Instant::now();
        let mut clock = counters.clock();
        std::thread::sleep(std::time::Duration::from_millis(3));
        clock.lap(Phase::Attention);
        std::thread::sleep(std::time::Duration::from_millis(1));
        clock.lap(Phase::Other);
        clock.finish();
        let wall = t0.elapsed().as_nanos() as u64;
        let got = counters.take();
        assert_eq!((got.linear_ns, got.steps), (0, 1));
        assert!(
            got.attention_ns >= 3_000_000 && got.other_ns >= 1_000_000,
            "{got:?}"
        );
        assert!(
            got.attention_ns + got.other_ns <= wall,
            "{got:?} vs {wall} ns of wall time"
        );
        assert_eq!(counters.take(), PhaseTotals::default(), "take zeroes");
        counters.set_enabled(false);
        counters.clock().finish();
        assert_eq!(counters.take().steps, 0, "off again");
    }
}
