//! PyO3 bindings of guided decoding (`guided`): `TokenVocab` (the model's vocabulary as a byte
//! trie, built once), `GuidedGrammar` (one compiled regex, shared by every request that uses
//! it, safe to use from any thread) and `GuidedSequence` (one sequence's position in a grammar).
//!
//! DFA state ids never cross into Python: a sequence is an opaque object, so Python cannot hand
//! the DFA an id it did not produce. Every bad input is a `ValueError`.

use crate::guided::{Grammar, GuidedError, GuidedSequence, TokenTrie, DEFAULT_SIZE_LIMIT_BYTES};
use numpy::{PyReadwriteArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyString};
use std::sync::Arc;

fn to_py(e: GuidedError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// `TokenVocab(token_bytes, vocab_size)`: `token_bytes[i]` is token `i`'s bytes (`b""` for a
/// special token, which guided decoding never emits); ids from `len(token_bytes)` up to
/// `vocab_size` are padding and never allowed either.
#[pyclass(name = "TokenVocab", module = "ferrobatch._scheduler", frozen)]
pub struct PyTokenVocab {
    trie: Arc<TokenTrie>,
}

#[pymethods]
impl PyTokenVocab {
    #[new]
    fn new(token_bytes: Vec<Bound<'_, PyBytes>>, vocab_size: usize) -> PyResult<Self> {
        let tokens: Vec<Vec<u8>> = token_bytes.iter().map(|b| b.as_bytes().to_vec()).collect();
        Ok(PyTokenVocab {
            trie: Arc::new(TokenTrie::new(&tokens, vocab_size).map_err(to_py)?),
        })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.trie.vocab_size()
    }

    /// Nodes of the byte trie (one per distinct token prefix, plus the root).
    #[getter]
    fn num_nodes(&self) -> usize {
        self.trie.num_nodes()
    }
}

/// `GuidedGrammar(pattern, vocab, eos_token_ids, size_limit_bytes=64 MiB)`: compiles `pattern`
/// (Rust regex syntax) so that only its full matches can be generated; an end-of-sequence token
/// is allowed exactly where the output is a full match. Compiling releases the GIL.
#[pyclass(name = "GuidedGrammar", module = "ferrobatch._scheduler", frozen)]
pub struct PyGuidedGrammar {
    inner: Arc<Grammar>,
}

#[pymethods]
impl PyGuidedGrammar {
    #[new]
    #[pyo3(signature = (pattern, vocab, eos_token_ids, size_limit_bytes = DEFAULT_SIZE_LIMIT_BYTES))]
    fn new(
        py: Python<'_>,
        pattern: String,
        vocab: &PyTokenVocab,
        eos_token_ids: Vec<u32>,
        size_limit_bytes: usize,
    ) -> PyResult<Self> {
        let trie = Arc::clone(&vocab.trie);
        let grammar = py
            .detach(move || Grammar::new(&pattern, trie, &eos_token_ids, size_limit_bytes))
            .map_err(to_py)?;
        Ok(PyGuidedGrammar {
            inner: Arc::new(grammar),
        })
    }

    /// A new sequence at the grammar's start.
    fn start(&self) -> PyGuidedSequence {
        PyGuidedSequence {
            inner: GuidedSequence::new(Arc::clone(&self.inner)),
        }
    }

    /// True when `text` (str or bytes) is a full match.
    fn matches(&self, text: &Bound<'_, PyAny>) -> PyResult<bool> {
        if let Ok(s) = text.cast::<PyString>() {
            return Ok(self.inner.matches(s.to_str()?.as_bytes()));
        }
        if let Ok(b) = text.cast::<PyBytes>() {
            return Ok(self.inner.matches(b.as_bytes()));
        }
        Err(PyValueError::new_err("matches() takes str or bytes"))
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// Bytes held by the DFA.
    #[getter]
    fn dfa_memory_bytes(&self) -> usize {
        self.inner.dfa_memory_bytes()
    }

    /// DFA states whose allowed tokens are cached (each costs vocab_size / 8 bytes).
    #[getter]
    fn num_cached_states(&self) -> usize {
        self.inner.num_cached_states()
    }
}

/// One sequence's position in a grammar: which tokens may come next, and moving past one.
#[pyclass(name = "GuidedSequence", module = "ferrobatch._scheduler")]
pub struct PyGuidedSequence {
    inner: GuidedSequence,
}

#[pymethods]
impl PyGuidedSequence {
    /// Moves past `token_id`; returns False (and stays put) when the grammar does not allow it.
    fn advance(&mut self, token_id: i64) -> bool {
        token_id >= 0 && self.inner.advance(token_id as usize)
    }

    /// Writes the allowed-token mask into `mask` (bool, length vocab_size, C-contiguous);
    /// returns how many tokens are allowed.
    fn write_mask(&self, py: Python<'_>, mut mask: PyReadwriteArray1<'_, bool>) -> PyResult<usize> {
        let allowed = self.inner.allowed_tokens();
        let want = self.vocab_size();
        if mask.len() != want {
            return Err(PyValueError::new_err(format!(
                "mask has {} entries, the vocabulary {want}",
                mask.len()
            )));
        }
        let out = mask
            .as_slice_mut()
            .map_err(|_| PyValueError::new_err("mask must be C-contiguous"))?;
        py.detach(|| allowed.write_mask(out));
        Ok(allowed.count)
    }

    /// The allowed token ids, ascending.
    fn allowed_token_ids(&self) -> Vec<u32> {
        self.inner.allowed_tokens().ids()
    }

    /// How many tokens are allowed next (0 once finished).
    #[getter]
    fn num_allowed(&self) -> usize {
        self.inner.allowed_tokens().count
    }

    /// The output so far is a full match.
    #[getter]
    fn is_accepting(&self) -> bool {
        self.inner.is_accepting()
    }

    /// An end-of-sequence token was accepted.
    #[getter]
    fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// An independent copy at the same position (for the `n` sequences of one request).
    fn copy(&self) -> PyGuidedSequence {
        PyGuidedSequence {
            inner: self.inner.clone(),
        }
    }
}
