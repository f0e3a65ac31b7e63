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

/// The linear kernels' buffer checks: each `(name, len, want)` must have `want` elements.
pub(crate) fn check_lengths(buffers: &[(&str, usize, usize)]) -> Result<(), KernelInputError> {
    match buffers.iter().find(|(_, len, want)| len != want) {
        Some((name, len, want)) => Err(KernelInputError(format!(
            "{name} has {len} elements, the shape needs {want}"
        ))),
        None => Ok(()),
    }
}

/// A bias is empty (none) or has one element per output feature.
pub(crate) fn check_bias(bias_len: usize, n: usize) -> Result<(), KernelInputError> {
    if bias_len != 0 && bias_len != n {
        return Err(KernelInputError(format!(
            "bias has {bias_len} elements, expected {n} (or none)"
        )));
    }
    Ok(())
}
