//! The CPU kernels' thread pool: persistent workers that spin briefly after each job, then sleep.
//!
//! A decode step calls a kernel ~150 times (every linear layer and attention of every layer),
//! each for 20 µs to a few ms; spawning threads per call cost ~100 µs each on the dev VM, more
//! than many of the calls themselves. Here a call wakes workers that are, within a step, still
//! spinning from the previous call (no syscall), and workers go to sleep after [`SPIN`] without
//! work, so an idle engine holds no core.
//!
//! Invariants:
//! - One job at a time: [`Pool::run`] holds `dispatch` for the whole job. A call that finds the
//!   pool busy (another thread's job, or a kernel calling a kernel) runs its tasks inline instead
//!   of waiting, so the pool can never deadlock on itself.
//! - The job (a closure on the caller's stack) is only reachable while the caller is inside
//!   [`Pool::run`]: the caller returns only after `pending` is back to 0, i.e. after every worker
//!   has finished with it, and workers read the job pointer only between seeing a new `epoch` and
//!   decrementing `pending`.
//! - No lost wake-up, by the mutex alone: a worker re-checks `epoch` and registers as a sleeper
//!   under `sleepers` (the mutex) and waits on `wake`, which releases it atomically; the caller
//!   bumps `epoch` before it takes the same mutex to look for sleepers. Whichever takes the mutex
//!   first, the worker either sees the new epoch or is counted and waiting when `notify_all` comes.
//! - A panicking task does not leave the job dangling: every task runs under `catch_unwind`, the
//!   caller still waits for all workers, then re-raises the panic on its own thread.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Duration;
use sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use sync::{spawn_worker, Arc, Condvar, Mutex, SpinClock};

// Under `--cfg loom` (model check: `tests/loom_pool.rs`) the atomics, mutex, condvar and threads
// come from loom, a poll yields to loom's scheduler, and the spin window is one poll, so the
// model explores both the "still polling" and the "asleep" hand-offs.
#[cfg(not(loom))]
mod sync {
    pub use std::sync::{atomic, Arc, Condvar, Mutex};
    use std::time::Instant;

    pub fn spawn_worker(index: usize, body: impl FnOnce() + Send + 'static) {
        std::thread::Builder::new()
            .name(format!("ferrobatch-cpu-{index}"))
            .spawn(body)
            .expect("spawning a CPU kernel worker thread");
    }

    /// Time since a worker's last job, checked every 256 polls.
    pub struct SpinClock {
        start: Instant,
        polls: u32,
    }

    impl SpinClock {
        pub fn start() -> SpinClock {
            SpinClock {
                start: Instant::now(),
                polls: 0,
            }
        }
        /// Polls once more; false once `window` has passed (or at once for a zero window).
        pub fn keep_polling(&mut self, window: std::time::Duration) -> bool {
            self.polls = self.polls.wrapping_add(1);
            if window.is_zero() {
                return false;
            }
            std::hint::spin_loop();
            !self.polls.is_multiple_of(256) || self.start.elapsed() < window
        }
    }

    pub fn pause() {
        std::hint::spin_loop();
    }
}

#[cfg(loom)]
mod sync {
    pub use loom::sync::{atomic, Arc, Condvar, Mutex};

    pub fn spawn_worker(_index: usize, body: impl FnOnce() + Send + 'static) {
        loom::thread::spawn(body);
    }

    pub struct SpinClock {
        polled: bool,
    }

    impl SpinClock {
        pub fn start() -> SpinClock {
            SpinClock { polled: false }
        }
        pub fn keep_polling(&mut self, _window: std::time::Duration) -> bool {
            loom::thread::yield_now();
            !std::mem::replace(&mut self.polled, true)
        }
    }

    pub fn pause() {
        loom::thread::yield_now();
    }
}

/// How long a worker keeps polling for the next job before it sleeps.
pub const SPIN: Duration = Duration::from_micros(500);

/// One job: `tasks` calls of `f(task)`, task 0 on the caller.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
}

struct Shared {
    epoch: AtomicU64,
    job: AtomicPtr<Job<'static>>,
    pending: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Workers waiting on `wake`.
    sleepers: Mutex<usize>,
    wake: Condvar,
}

/// A fixed set of worker threads (see the module header).
pub struct Pool {
    shared: Arc<Shared>,
    workers: usize,
    dispatch: Mutex<()>,
}

impl Pool {
    /// A pool with `workers` threads besides the caller's.
    pub fn new(workers: usize) -> Pool {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
        });
        for index in 1..=workers {
            let shared = Arc::clone(&shared);
            spawn_worker(index, move || worker_loop(&shared, index));
        }
        Pool {
            shared,
            workers,
            dispatch: Mutex::new(()),
        }
    }

    /// Threads a job can use (the workers plus the caller).
    pub fn max_tasks(&self) -> usize {
        self.workers + 1
    }

    /// Calls `f(0)`, ..., `f(tasks - 1)`, concurrently when the pool is free (task 0 on the
    /// calling thread, task `i` on worker `i`), and returns when all have returned. `tasks` is
    /// capped at [`Pool::max_tasks`]: callers split their work by the number of tasks they ask
    /// for, so they must ask for at most that many.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(
            tasks <= self.max_tasks(),
            "{tasks} tasks for a pool of {}",
            self.max_tasks()
        );
        let guard = match self.dispatch.try_lock() {
            Ok(guard) if tasks > 1 => guard,
            _ => {
                (0..tasks).for_each(f);
                return;
            }
        };
        let job = Job { f, tasks };
        let s = &*self.shared;
        // SAFETY of the lifetime cast: the pointer is cleared and every worker is done with the
        // job (pending == 0) before this function returns (module header).
        let ptr = &job as *const Job<'_> as *mut Job<'static>;
        s.job.store(ptr, SeqCst);
        s.pending.store(self.workers, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        if *s.sleepers.lock().unwrap_or_else(|e| e.into_inner()) > 0 {
            s.wake.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| f(0)));
        while s.pending.load(SeqCst) != 0 {
            sync::pause();
        }
        s.job.store(std::ptr::null_mut(), SeqCst);
        let worker_panicked = s.panicked.swap(false, SeqCst);
        drop(guard);
        if let Err(payload) = mine {
            resume_unwind(payload);
        }
        assert!(
            !worker_panicked,
            "a CPU kernel task panicked on a worker thread"
        );
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        let _sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
        s.wake.notify_all();
    }
}

fn worker_loop(s: &Shared, index: usize) {
    // Epoch 0 = no job yet. (Not a load: a worker that starts after the first job was published
    // must still take part in it.)
    let mut seen = 0;
    loop {
        let mut clock = SpinClock::start();
        loop {
            if s.epoch.load(SeqCst) != seen {
                break;
            }
            if clock.keep_polling(SPIN) {
                continue;
            }
            let mut sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            *sleepers += 1;
            while s.epoch.load(SeqCst) == seen {
                sleepers = s.wake.wait(sleepers).unwrap_or_else(|e| e.into_inner());
            }
            *sleepers -= 1;
            break;
        }
        if s.shutdown.load(SeqCst) {
            return;
        }
        seen = s.epoch.load(SeqCst);
        let job = s.job.load(SeqCst);
        // SAFETY: a new epoch was published after the job pointer, and the caller keeps the job
        // alive until this worker decrements `pending` below (module header).
        if let Some(job) = unsafe { job.as_ref() } {
            if index < job.tasks && catch_unwind(AssertUnwindSafe(|| (job.f)(index))).is_err() {
                s.panicked.store(true, SeqCst);
            }
        }
        s.pending.fetch_sub(1, SeqCst);
    }
}

/// Calls `f(i)` once for each `i` in `0..items`, the items taken one at a time by up to
/// `threads` threads of the [`global`] pool (the caller's among them): for work whose items
/// differ in cost, such as a step's rows for the sampler's kernels.
pub fn for_each_item(items: usize, threads: usize, f: &(dyn Fn(usize) + Sync)) {
    let wanted = threads.min(items).max(1);
    if wanted == 1 {
        (0..items).for_each(f);
        return;
    }
    let pool = global(wanted);
    let next = AtomicUsize::new(0);
    pool.run(wanted.min(pool.max_tasks()), &|_task| loop {
        let i = next.fetch_add(1, SeqCst);
        if i >= items {
            break;
        }
        f(i);
    });
}

/// A `*mut T` shared by the tasks of one job, each writing only elements no other task
/// writes, through [`SharedMut::get`] (a method, so a closure captures the whole wrapper).
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub(crate) *mut T);
// SAFETY: users write disjoint elements from the tasks of one job, and the buffer outlives it.
unsafe impl<T> Sync for SharedMut<T> {}
impl<T> SharedMut<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// The process-wide pool, sized on first use to `threads - 1` workers (later calls asking for
/// more threads get at most that many: see [`Pool::max_tasks`]).
pub fn global(threads: usize) -> &'static Pool {
    static POOL: std::sync::OnceLock<Pool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| Pool::new(threads.max(available_threads()).saturating_sub(1)))
}

/// The machine's hardware threads (1 if unknown).
pub fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once_per_job() {
        let pool = Pool::new(3);
        for tasks in [1, 2, 3, 4, 1, 4] {
            let hits: Vec<AtomicU32> = (0..4).map(|_| AtomicU32::new(0)).collect();
            pool.run(tasks, &|t| {
                hits[t].fetch_add(1, SeqCst);
            });
            for (t, h) in hits.iter().enumerate() {
                assert_eq!(h.load(SeqCst), u32::from(t < tasks), "task {t} of {tasks}");
            }
        }
    }

    #[test]
    fn for_each_item_calls_every_item_once() {
        for items in [0, 1, 2, 3, 7, 40] {
            for threads in [1, 2, 3, 8] {
                let hits: Vec<AtomicU32> = (0..items).map(|_| AtomicU32::new(0)).collect();
                for_each_item(items, threads, &|i| {
                    hits[i].fetch_add(1, SeqCst);
                });
                assert!(
                    hits.iter().all(|h| h.load(SeqCst) == 1),
                    "{items} on {threads}"
                );
            }
        }
    }

    #[test]
    fn tasks_run_on_distinct_threads() {
        let pool = Pool::new(2);
        let ids = Mutex::new(Vec::new());
        pool.run(3, &|_| {
            ids.lock().unwrap().push(std::thread::current().id());
            std::thread::sleep(Duration::from_millis(5));
        });
        let mut ids = ids.into_inner().unwrap();
        ids.sort_by_key(|id| format!("{id:?}"));
        ids.dedup();
        assert_eq!(ids.len(), 3);
    }

    #[test]
    fn wakes_sleeping_workers() {
        let pool = Pool::new(1);
        let count = AtomicU32::new(0);
        for _ in 0..3 {
            std::thread::sleep(SPIN * 4); // the worker is asleep by now
            pool.run(2, &|_| {
                count.fetch_add(1, SeqCst);
            });
        }
        assert_eq!(count.load(SeqCst), 6);
    }

    #[test]
    fn a_busy_pool_runs_the_job_inline() {
        let pool = Pool::new(1);
        let inner = AtomicU32::new(0);
        pool.run(2, &|t| {
            if t == 0 {
                // a nested call finds the pool busy: it must not wait for itself
                pool.run(2, &|_| {
                    inner.fetch_add(1, SeqCst);
                });
            }
        });
        assert_eq!(inner.load(SeqCst), 2);
    }

    #[test]
    fn concurrent_callers_all_finish() {
        let pool = Pool::new(2);
        let total = AtomicU32::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..200 {
                        pool.run(3, &|_| {
                            total.fetch_add(1, SeqCst);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(SeqCst), 4 * 200 * 3);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_the_pool_survives() {
        let pool = Pool::new(1);
        for bad_task in [0, 1] {
            let caught = catch_unwind(AssertUnwindSafe(|| {
                pool.run(2, &|t| assert!(t != bad_task, "task {t} fails"));
            }));
            assert!(caught.is_err(), "task {bad_task}'s panic was lost");
        }
        let count = AtomicU32::new(0);
        pool.run(2, &|_| {
            count.fetch_add(1, SeqCst);
        });
        assert_eq!(count.load(SeqCst), 2);
    }

    #[test]
    #[should_panic(expected = "tasks for a pool of")]
    fn more_tasks_than_threads_is_a_caller_bug() {
        Pool::new(1).run(3, &|_| {});
    }
}
