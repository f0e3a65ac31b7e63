//! Error types. A user error is a [`SchedError`] (mapped to `ValueError` / `QueueFullError` by
//! the bindings); a broken invariant is an [`IntegrityError`] (a bug, `RuntimeError`).

use thiserror::Error;

/// Errors caused by the caller: bad configuration, bad request, protocol misuse, full queue.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SchedError {
    /// The configuration is invalid.
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(String),
    /// A submitted request is invalid (never queued).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The bounded intake queue is full; retry later (HTTP 429).
    #[error("intake queue is full ({0} commands pending); retry later")]
    QueueFull(usize),
    /// `schedule()` / `update()` called out of order or with the wrong number of samples.
    #[error("{0}")]
    Protocol(String),
}

/// A broken internal invariant found by `check_integrity()`.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("integrity check failed: {0}")]
pub struct IntegrityError(pub String);
