//! Lock-free intake queue with a wake-up protocol for the step thread.
//!
//! Any thread pushes commands (submit / abort) onto a bounded lock-free queue
//! (`crossbeam_queue::ArrayQueue`) and never waits for the step; a full queue is an immediate
//! error. The step thread drains everything at the top of each `schedule()`, and when idle it
//! sleeps in [`IntakeQueue::wait_for_work`] until something is pushed.
//!
//! Wake-up protocol (no lost wake-ups; model-checked by `tests/loom_intake.rs`):
//! - pusher: `queue.push`, then `pending += 1`, then reads `sleepers`; if > 0: lock the mutex
//!   and `notify_all`;
//! - waiter: `sleepers += 1`, lock the mutex, and while `pending <= 0` (read) and no `notify()`
//!   is outstanding, wait on the condvar (which releases the mutex atomically).
//!
//! Both "reads" are read-modify-writes (`fetch_add(0)`), which always read the latest value and
//! synchronize with the RMW they read from. So if the waiter's read of `pending` misses a push,
//! it precedes that push's `pending += 1` in modification order and happens-before it; hence
//! the waiter's `sleepers += 1` happens-before the pusher's read, which sees `sleepers > 0`.
//! The pusher's notify then needs the mutex, which the waiter only gives up by sleeping, so the
//! notify cannot fall between the waiter's check and its sleep. (A plain SeqCst store/load
//! pair would also do on real hardware, but loom models SeqCst as AcqRel and rightly rejects
//! that Dekker pattern under its model; RMWs make the argument hold under both.)
//! `pending` counts pushed-and-not-drained commands; it is incremented after the push, so it may
//! lag (never lead) the queue: `pending > 0` always means there is a command to drain.
//!
//! Under `--cfg loom` the queue is a bounded `loom::sync::Mutex<VecDeque>` and all atomics, the
//! mutex and the condvar come from `loom::sync` (loom's condvar never times out, so the model
//! proves wake-ups without relying on timeouts).

use std::time::Duration;

#[cfg(not(loom))]
mod sync {
    pub use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};
    pub use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Bounded MPMC lock-free queue.
    pub struct Bounded<T>(crossbeam_queue::ArrayQueue<T>);
    impl<T> Bounded<T> {
        pub fn new(cap: usize) -> Self {
            Bounded(crossbeam_queue::ArrayQueue::new(cap))
        }
        pub fn push(&self, v: T) -> Result<(), T> {
            self.0.push(v)
        }
        pub fn pop(&self) -> Option<T> {
            self.0.pop()
        }
    }

    /// Mutex + condvar used only for sleeping / waking.
    #[derive(Default)]
    pub struct Bell {
        m: parking_lot::Mutex<()>,
        cv: parking_lot::Condvar,
    }
    impl Bell {
        pub fn ring(&self) {
            let _g = self.m.lock();
            self.cv.notify_all();
        }
        /// Sleeps while `idle()` holds (checked under the mutex), at most `timeout`.
        pub fn sleep_while(&self, mut idle: impl FnMut() -> bool, timeout: Option<Duration>) {
            let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
            let mut g = self.m.lock();
            while idle() {
                match deadline {
                    None => self.cv.wait(&mut g),
                    Some(d) => {
                        if self.cv.wait_until(&mut g, d).timed_out() {
                            return;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(loom)]
mod sync {
    pub use loom::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};
    pub use loom::sync::Arc;
    use std::collections::VecDeque;
    use std::time::Duration;

    /// Bounded queue stand-in (loom cannot see inside crossbeam).
    pub struct Bounded<T> {
        q: loom::sync::Mutex<VecDeque<T>>,
        cap: usize,
    }
    impl<T> Bounded<T> {
        pub fn new(cap: usize) -> Self {
            Bounded {
                q: loom::sync::Mutex::new(VecDeque::new()),
                cap,
            }
        }
        pub fn push(&self, v: T) -> Result<(), T> {
            let mut q = self.q.lock().unwrap();
            if q.len() >= self.cap {
                return Err(v);
            }
            q.push_back(v);
            Ok(())
        }
        pub fn pop(&self) -> Option<T> {
            self.q.lock().unwrap().pop_front()
        }
    }

    #[derive(Default)]
    pub struct Bell {
        m: loom::sync::Mutex<()>,
        cv: loom::sync::Condvar,
    }
    impl Bell {
        pub fn ring(&self) {
            let _g = self.m.lock().unwrap();
            self.cv.notify_all();
        }
        pub fn sleep_while(&self, mut idle: impl FnMut() -> bool, _timeout: Option<Duration>) {
            let mut g = self.m.lock().unwrap();
            while idle() {
                g = self.cv.wait(g).unwrap();
            }
        }
    }
}

use sync::*;

struct Inner<T> {
    queue: Bounded<T>,
    capacity: usize,
    pending: AtomicIsize,
    sleepers: AtomicUsize,
    notified: AtomicBool,
    bell: Bell,
}

/// A cheap, clonable, thread-safe handle to the bounded intake queue.
pub struct IntakeQueue<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for IntakeQueue<T> {
    fn clone(&self) -> Self {
        IntakeQueue {
            inner: self.inner.clone(),
        }
    }
}

impl<T> IntakeQueue<T> {
    /// A queue holding at most `capacity` (>= 1) undrained commands.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        IntakeQueue {
            inner: Arc::new(Inner {
                queue: Bounded::new(capacity),
                capacity,
                pending: AtomicIsize::new(0),
                sleepers: AtomicUsize::new(0),
                notified: AtomicBool::new(false),
                bell: Bell::default(),
            }),
        }
    }

    /// Pushes a command without blocking; gives it back when the queue is full.
    pub fn push(&self, cmd: T) -> Result<(), T> {
        let i = &*self.inner;
        i.queue.push(cmd)?;
        i.pending.fetch_add(1, Ordering::SeqCst);
        // An RMW (not a load): it reads the latest `sleepers`, see the module header.
        if i.sleepers.fetch_add(0, Ordering::SeqCst) > 0 {
            i.bell.ring();
        }
        Ok(())
    }

    /// Pops every queued command (in push order per pusher) into `f`; returns how many.
    pub fn drain(&self, mut f: impl FnMut(T)) -> usize {
        let i = &*self.inner;
        let mut n = 0;
        while let Some(c) = i.queue.pop() {
            f(c);
            n += 1;
        }
        if n > 0 {
            i.pending.fetch_sub(n as isize, Ordering::SeqCst);
        }
        n
    }

    /// Commands pushed and not yet drained (may briefly lag a concurrent push).
    pub fn len(&self) -> usize {
        self.inner.pending.load(Ordering::SeqCst).max(0) as usize
    }

    /// True when no command is waiting to be drained.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Capacity of the queue.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Blocks until a command is queued (returns true at once if one already is), `notify()` is
    /// called, or `timeout` passes (`None` = no timeout). Returns whether a command is queued.
    pub fn wait_for_work(&self, timeout: Option<Duration>) -> bool {
        let i = &*self.inner;
        if i.pending.load(Ordering::SeqCst) > 0 {
            return true;
        }
        i.sleepers.fetch_add(1, Ordering::SeqCst);
        i.bell.sleep_while(
            || {
                i.pending.fetch_add(0, Ordering::SeqCst) <= 0
                    && !i.notified.swap(false, Ordering::SeqCst)
            },
            timeout,
        );
        i.sleepers.fetch_sub(1, Ordering::SeqCst);
        i.pending.load(Ordering::SeqCst) > 0
    }

    /// Wakes every waiter (or the next one to wait, if none waits now); used at shutdown.
    pub fn notify(&self) {
        let i = &*self.inner;
        i.notified.swap(true, Ordering::SeqCst); // RMW, like every flag access here
        i.bell.ring();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::thread;

    #[test]
    fn bounded_push_and_drain() {
        let q = IntakeQueue::new(2);
        assert!(q.push(1).is_ok());
        assert!(q.push(2).is_ok());
        assert_eq!(q.push(3), Err(3));
        assert_eq!(q.len(), 2);
        let mut got = vec![];
        assert_eq!(q.drain(|c| got.push(c)), 2);
        assert_eq!(got, vec![1, 2]);
        assert!(q.is_empty());
    }

    #[test]
    fn wait_returns_on_push_notify_and_timeout() {
        let q = IntakeQueue::<u32>::new(4);
        assert!(!q.wait_for_work(Some(Duration::from_millis(5))));
        let q2 = q.clone();
        let h = thread::spawn(move || {
            thread::sleep(Duration::from_millis(20));
            q2.push(7).unwrap();
        });
        assert!(q.wait_for_work(Some(Duration::from_secs(10))));
        h.join().unwrap();
        q.drain(|_| {});
        let q3 = q.clone();
        let h = thread::spawn(move || {
            thread::sleep(Duration::from_millis(20));
            q3.notify();
        });
        assert!(!q.wait_for_work(Some(Duration::from_secs(10))));
        h.join().unwrap();
    }

    #[test]
    fn many_pushers_nothing_lost() {
        let q = IntakeQueue::<u64>::new(64);
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let q = q.clone();
                thread::spawn(move || {
                    for k in 0..1000 {
                        let mut v = t * 10_000 + k;
                        while let Err(back) = q.push(v) {
                            v = back;
                            thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut got = 0;
        while got < 4000 {
            q.wait_for_work(Some(Duration::from_secs(10)));
            got += q.drain(|_| {});
        }
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(got, 4000);
        assert!(q.is_empty());
    }
}
