//! The CPU kernels' one error: an input whose shape, length or index does not fit the buffers it
//! came with. Every kernel checks its inputs before reading them and returns this instead of
//! reading out of bounds; the Python bindings turn it into `ValueError`.

use std::fmt;

/// A shape, length or index that would read or write outside the caller's buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelInputError(pub String);

impl fmt::Display for KernelInputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KernelInputError {}
