//! loom model of the CPU kernels' thread pool (`cpu_pool`): a caller hands jobs to a worker that
//! may be polling or asleep. A lost wake-up leaves the caller polling `pending` forever, which
//! loom reports as "Model exceeded maximum number of branches" (checked: notifying only when
//! sleepers were seen *before* the epoch bump fails this model that way); a task run twice or
//! never fails the counts below.
//! Run with `make test-loom` (RUSTFLAGS="--cfg loom", LOOM_MAX_PREEMPTIONS=2).
#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use rust_scheduler::cpu_pool::Pool;

#[test]
fn two_jobs_each_task_once_no_lost_wakeup() {
    loom::model(|| {
        let pool = Pool::new(1);
        for job in 0..2 {
            let hits = [AtomicUsize::new(0), AtomicUsize::new(0)];
            pool.run(2, &|t| {
                hits[t].fetch_add(1, SeqCst);
            });
            for (t, h) in hits.iter().enumerate() {
                assert_eq!(h.load(SeqCst), 1, "job {job}: task {t}");
            }
        }
        drop(pool); // the worker must exit: loom fails a model whose threads never finish
    });
}
