//! loom model of the intake as the engine uses it: submitter threads push commands while the
//! step thread drains and sleeps in `wait_for_work` when idle. A lost wake-up would leave the
//! step thread asleep with work queued: loom reports that as a deadlock in some interleaving.
//! Run with `make test-loom` (RUSTFLAGS="--cfg loom", LOOM_MAX_PREEMPTIONS=2).
#![cfg(loom)]

use loom::thread;
use rust_scheduler::queue::IntakeQueue;

/// The step thread's idle loop: drain, and sleep only while nothing is queued.
fn step_thread(q: &IntakeQueue<u32>, expect: usize) -> Vec<u32> {
    let mut got = Vec::new();
    loop {
        q.drain(|c| got.push(c));
        if got.len() == expect {
            return got;
        }
        q.wait_for_work(None);
    }
}

#[test]
fn two_submitters_no_lost_wakeup() {
    loom::model(|| {
        let q = IntakeQueue::new(4);
        let hs: Vec<_> = [1u32, 2]
            .into_iter()
            .map(|v| {
                let q = q.clone();
                thread::spawn(move || q.push(v).unwrap())
            })
            .collect();
        let mut got = step_thread(&q, 2);
        for h in hs {
            h.join().unwrap();
        }
        got.sort();
        assert_eq!(got, vec![1, 2]);
        assert!(q.is_empty());
    });
}

#[test]
fn submit_then_abort_from_one_thread_keeps_order() {
    loom::model(|| {
        let q = IntakeQueue::new(4);
        let q2 = q.clone();
        let h = thread::spawn(move || {
            q2.push(10).unwrap(); // submit
            q2.push(11).unwrap(); // abort of the same request
        });
        let got = step_thread(&q, 2);
        h.join().unwrap();
        assert_eq!(got, vec![10, 11]);
    });
}

#[test]
fn full_queue_rejects_without_losing_accepted_commands() {
    loom::model(|| {
        let q = IntakeQueue::new(1);
        let hs: Vec<_> = [1u32, 2]
            .into_iter()
            .map(|v| {
                let q = q.clone();
                thread::spawn(move || {
                    let mut v = v;
                    // "429, retry": a rejected command is handed back intact.
                    while let Err(back) = q.push(v) {
                        v = back;
                        thread::yield_now();
                    }
                })
            })
            .collect();
        let mut got = step_thread(&q, 2);
        for h in hs {
            h.join().unwrap();
        }
        got.sort();
        assert_eq!(got, vec![1, 2]);
    });
}

#[test]
fn notify_wakes_an_idle_step_thread() {
    loom::model(|| {
        let q = IntakeQueue::<u32>::new(2);
        let q2 = q.clone();
        let h = thread::spawn(move || q2.notify());
        // Returns (false: nothing queued) once notified, whichever runs first.
        assert!(!q.wait_for_work(None));
        h.join().unwrap();
    });
}
