//! The intake handle: validates requests synchronously and pushes commands onto the bounded
//! lock-free queue; never blocks and never touches scheduler state.
//!
//! Invariants:
//! - only validated requests are queued (so every queued request can fit);
//! - `live` holds the id of every request submitted and not yet terminated (queued, waiting or
//!   running); a submit with a live id is rejected; the scheduler removes an id when the last
//!   sequence of its request reaches a terminal state.

use crate::config::SchedulerConfig;
use crate::error::SchedError;
use crate::queue::IntakeQueue;
use crate::request::{FinishReason, NewRequest};
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// A command for the step thread.
#[derive(Debug)]
pub enum Command {
    /// A validated new request.
    Submit(Box<NewRequest>),
    /// Abort one sequence (`Some(index)`) or all sequences (`None`) of a request.
    Abort {
        /// Request to abort (unknown ids are ignored).
        request_id: u64,
        /// Sequence index, or all.
        seq_index: Option<u32>,
        /// Reported finish reason (Abort, Stop or Error).
        reason: FinishReason,
    },
}

/// Clonable, thread-safe handle for submitting and aborting requests.
#[derive(Clone)]
pub struct Intake {
    queue: IntakeQueue<Command>,
    cfg: Arc<SchedulerConfig>,
    live: Arc<Mutex<HashSet<u64>>>,
}

impl Intake {
    pub(crate) fn new(cfg: Arc<SchedulerConfig>) -> Self {
        Intake {
            queue: IntakeQueue::new(cfg.intake_capacity),
            cfg,
            live: Arc::new(Mutex::new(HashSet::new())),
        }
    }

    /// Validates and enqueues a request. Errors: `InvalidRequest` (bad input, cannot ever fit,
    /// duplicate live id) or `QueueFull`.
    pub fn submit(&self, req: NewRequest) -> Result<(), SchedError> {
        req.validate(&self.cfg)?;
        let id = req.request_id;
        if !self.live.lock().insert(id) {
            return Err(SchedError::InvalidRequest(format!(
                "request id {id} is already in use"
            )));
        }
        if self.queue.push(Command::Submit(Box::new(req))).is_err() {
            self.live.lock().remove(&id);
            return Err(SchedError::QueueFull(self.queue.len()));
        }
        Ok(())
    }

    /// Enqueues an abort (idempotent: unknown or finished ids are ignored when drained).
    /// `reason` must be Abort, Stop or Error.
    pub fn abort(
        &self,
        request_id: u64,
        seq_index: Option<u32>,
        reason: FinishReason,
    ) -> Result<(), SchedError> {
        if matches!(reason, FinishReason::Running | FinishReason::Length) {
            return Err(SchedError::InvalidRequest(
                "abort reason must be abort, stop or error".into(),
            ));
        }
        self.queue
            .push(Command::Abort {
                request_id,
                seq_index,
                reason,
            })
            .map_err(|_| SchedError::QueueFull(self.queue.len()))
    }

    /// See [`IntakeQueue::wait_for_work`].
    pub fn wait_for_work(&self, timeout: Option<Duration>) -> bool {
        self.queue.wait_for_work(timeout)
    }

    /// See [`IntakeQueue::notify`].
    pub fn notify(&self) {
        self.queue.notify()
    }

    /// Commands queued and not yet drained.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// Whether `request_id` is live (queued, waiting or running).
    pub fn is_live(&self, request_id: u64) -> bool {
        self.live.lock().contains(&request_id)
    }

    /// The configuration requests are validated against.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub(crate) fn drain(&self, f: impl FnMut(Command)) -> usize {
        self.queue.drain(f)
    }

    pub(crate) fn retire(&self, ids: &mut Vec<u64>) {
        if !ids.is_empty() {
            let mut live = self.live.lock();
            for id in ids.drain(..) {
                live.remove(&id);
            }
        }
    }

    pub(crate) fn live_ids(&self) -> HashSet<u64> {
        self.live.lock().clone()
    }
}
