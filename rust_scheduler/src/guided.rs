//! Guided decoding (structured outputs): which tokens may come next so that a sequence's output
//! stays a prefix of some full match of a regular expression.
//!
//! A regex is compiled once into an anchored, byte-level DFA (`regex-automata`, match kind
//! "all", the pattern wrapped as `(?:RE)$` so that a full match is only recognised at the end).
//! The vocabulary is a byte trie of every token's bytes (`TokenTrie`, built once per model and
//! shared by every grammar). The tokens allowed in a DFA state are found by walking the trie and
//! the DFA together, pruning a subtree as soon as the DFA dies; they are cached per state.
//!
//! Invariants (each checked by the tests below):
//! - A token is allowed in state `s` iff feeding its bytes to the DFA from `s` never reaches the
//!   dead state. Tokens with no bytes (special tokens) are never allowed.
//! - An end-of-sequence token is allowed in `s` iff `s` is accepting (the output so far is a full
//!   match); it is then the only way to leave an accepting state that no token can extend.
//! - `GuidedSequence::advance` accepts exactly the tokens `allowed_tokens` reports, so a sequence
//!   that only ever samples allowed tokens never leaves the set of live states.
//! - The per-state cache holds at most `MAX_CACHED_STATES` entries (it is emptied when full), so
//!   a grammar's memory stays bounded however many states its sequences visit.
//! - Compilation is bounded: the NFA, the determinisation and the DFA each have a size limit, and
//!   a pattern over it is refused with `GuidedError::TooLarge` instead of eating memory.

use parking_lot::Mutex;
use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::nfa::thompson;
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::util::syntax;
use regex_automata::{Anchored, MatchKind};
use regex_syntax::ast::{
    self, Ast, ClassAscii, ClassAsciiKind, ClassBracketed, ClassPerl, ClassPerlKind, ClassSet,
    ClassSetItem,
};
use regex_syntax::hir::{self, Hir, Look};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// Default bound on each of: the compiled NFA, the determiniser's working memory, the DFA.
pub const DEFAULT_SIZE_LIMIT_BYTES: usize = 64 << 20;

/// At most this many states keep their allowed tokens cached per grammar (each costs
/// vocab_size / 8 bytes: 6 KiB for a 49k vocabulary, so 12 MiB); past it the cache starts over.
pub const MAX_CACHED_STATES: usize = 2048;

/// Deepest nesting of groups / repetitions / classes a pattern may have.
const NEST_LIMIT: u32 = 200;

/// Parses `pattern` (Unicode on) with `\d`, `\w`, `\s` and their negations read as the ASCII
/// classes `[0-9]`, `[0-9A-Za-z_]`, `[\t\n\v\f\r ]`, as vLLM's grammar backends read them.
/// Unicode's `\d` also admits digits such as U+1FBF8 (four bytes, after a lead byte that emoji
/// tokens share), which a model would then be forced to spell out. `\p{Nd}` is Unicode's.
fn parse_ascii_perl(pattern: &str) -> Result<Hir, String> {
    let mut parsed = ast::parse::ParserBuilder::new()
        .nest_limit(NEST_LIMIT)
        .build()
        .parse(pattern)
        .map_err(|e| e.to_string())?;
    ascii_perl(&mut parsed);
    hir::translate::TranslatorBuilder::new()
        .unicode(true)
        .utf8(true)
        .build()
        .translate(pattern, &parsed)
        .map_err(|e| e.to_string())
}

fn ascii_kind(perl: &ClassPerl) -> ClassAscii {
    let kind = match perl.kind {
        ClassPerlKind::Digit => ClassAsciiKind::Digit,
        ClassPerlKind::Space => ClassAsciiKind::Space,
        ClassPerlKind::Word => ClassAsciiKind::Word,
    };
    ClassAscii {
        span: perl.span,
        kind,
        negated: perl.negated,
    }
}

/// Every Perl class in `node` (outside and inside brackets) replaced by its ASCII class.
/// Recursive, but the parser's nest limit bounds the depth.
fn ascii_perl(node: &mut Ast) {
    match node {
        Ast::ClassPerl(perl) => {
            let span = perl.span;
            let class = ClassSetItem::Ascii(ascii_kind(perl));
            *node = Ast::class_bracketed(ClassBracketed {
                span,
                negated: false,
                kind: ClassSet::Item(class),
            });
        }
        Ast::ClassBracketed(class) => ascii_perl_set(&mut class.kind),
        Ast::Repetition(rep) => ascii_perl(&mut rep.ast),
        Ast::Group(group) => ascii_perl(&mut group.ast),
        Ast::Alternation(alt) => alt.asts.iter_mut().for_each(ascii_perl),
        Ast::Concat(cat) => cat.asts.iter_mut().for_each(ascii_perl),
        _ => {}
    }
}

fn ascii_perl_set(set: &mut ClassSet) {
    match set {
        ClassSet::Item(item) => ascii_perl_item(item),
        ClassSet::BinaryOp(op) => {
            ascii_perl_set(&mut op.lhs);
            ascii_perl_set(&mut op.rhs);
        }
    }
}

fn ascii_perl_item(item: &mut ClassSetItem) {
    match item {
        ClassSetItem::Perl(perl) => *item = ClassSetItem::Ascii(ascii_kind(perl)),
        ClassSetItem::Bracketed(class) => ascii_perl_set(&mut class.kind),
        ClassSetItem::Union(union) => union.items.iter_mut().for_each(ascii_perl_item),
        _ => {}
    }
}

/// Why a grammar could not be built or used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuidedError {
    /// The regex does not parse, or uses a construct a DFA cannot run (e.g. look-around).
    BadPattern(String),
    /// The pattern's automaton would exceed the size limits.
    TooLarge(String),
    /// A token id outside the vocabulary, or a vocabulary that does not fit the model.
    BadToken(String),
}

impl fmt::Display for GuidedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GuidedError::BadPattern(m) | GuidedError::TooLarge(m) | GuidedError::BadToken(m) => {
                f.write_str(m)
            }
        }
    }
}

impl std::error::Error for GuidedError {}

/// An error and its causes, "outer: inner: ..." (regex-automata nests the parser's message).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        msg.push_str(": ");
        msg.push_str(&c.to_string());
        cause = c.source();
    }
    msg
}

/// The vocabulary as a byte trie. Node 0 is the root (the empty prefix).
pub struct TokenTrie {
    vocab_size: usize,
    /// Node `i`'s children are `edges[first_edge[i]..first_edge[i + 1]]`, sorted by byte.
    first_edge: Vec<u32>,
    /// (byte, child node)
    edges: Vec<(u8, u32)>,
    /// Node `i`'s tokens (ids whose bytes end exactly at that node) are
    /// `token_ids[first_token[i]..first_token[i + 1]]`.
    first_token: Vec<u32>,
    token_ids: Vec<u32>,
    /// Every token's bytes, for `advance`.
    token_bytes: Vec<Box<[u8]>>,
}

impl TokenTrie {
    /// `tokens[i]` is token `i`'s bytes (empty for a special token, never allowed);
    /// `vocab_size` >= `tokens.len()` (ids past the list are padding, never allowed).
    pub fn new(tokens: &[Vec<u8>], vocab_size: usize) -> Result<TokenTrie, GuidedError> {
        if tokens.len() > vocab_size || vocab_size > u32::MAX as usize {
            return Err(GuidedError::BadToken(format!(
                "{} token byte strings for a vocabulary of {vocab_size}",
                tokens.len()
            )));
        }
        // Build with per-node maps, then flatten into sorted arrays.
        let mut children: Vec<Vec<(u8, u32)>> = vec![Vec::new()];
        let mut ending: Vec<Vec<u32>> = vec![Vec::new()];
        for (id, bytes) in tokens.iter().enumerate() {
            if bytes.is_empty() {
                continue;
            }
            let mut node = 0usize;
            for &b in bytes {
                node = match children[node].iter().find(|(c, _)| *c == b) {
                    Some(&(_, child)) => child as usize,
                    None => {
                        let child = children.len();
                        children.push(Vec::new());
                        ending.push(Vec::new());
                        children[node].push((b, child as u32));
                        child
                    }
                };
            }
            ending[node].push(id as u32);
        }
        let mut first_edge = Vec::with_capacity(children.len() + 1);
        let mut edges = Vec::new();
        let mut first_token = Vec::with_capacity(children.len() + 1);
        let mut token_ids = Vec::new();
        for (kids, ends) in children.iter_mut().zip(&ending) {
            kids.sort_unstable();
            first_edge.push(edges.len() as u32);
            edges.extend_from_slice(kids);
            first_token.push(token_ids.len() as u32);
            token_ids.extend_from_slice(ends);
        }
        first_edge.push(edges.len() as u32);
        first_token.push(token_ids.len() as u32);
        let token_bytes = tokens
            .iter()
            .map(|t| t.clone().into_boxed_slice())
            .collect();
        Ok(TokenTrie {
            vocab_size,
            first_edge,
            edges,
            first_token,
            token_ids,
            token_bytes,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn num_nodes(&self) -> usize {
        self.first_edge.len() - 1
    }

    fn edges_of(&self, node: usize) -> &[(u8, u32)] {
        &self.edges[self.first_edge[node] as usize..self.first_edge[node + 1] as usize]
    }

    fn tokens_of(&self, node: usize) -> &[u32] {
        &self.token_ids[self.first_token[node] as usize..self.first_token[node + 1] as usize]
    }

    /// Token `id`'s bytes (empty for special or padding ids).
    pub fn bytes_of(&self, id: usize) -> &[u8] {
        self.token_bytes.get(id).map(|b| &b[..]).unwrap_or(&[])
    }
}

/// The tokens allowed in one DFA state, as a bit set over the vocabulary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedTokens {
    words: Vec<u64>,
    /// How many token ids are set (the end-of-sequence ids included when accepting).
    pub count: usize,
    /// The output so far is a full match: end-of-sequence may come now.
    pub accepting: bool,
}

impl AllowedTokens {
    pub fn contains(&self, id: usize) -> bool {
        self.words
            .get(id / 64)
            .is_some_and(|w| w >> (id % 64) & 1 == 1)
    }

    /// Writes `mask[i] = contains(i)` for every id of the vocabulary.
    pub fn write_mask(&self, mask: &mut [bool]) {
        for (i, m) in mask.iter_mut().enumerate() {
            *m = self.words[i / 64] >> (i % 64) & 1 == 1;
        }
    }

    /// The allowed ids, ascending.
    pub fn ids(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.count);
        for (w, &word) in self.words.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                out.push((w * 64) as u32 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
        out
    }
}

/// One compiled regex over one vocabulary; shared (`Arc`) by every sequence it guides.
pub struct Grammar {
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
    trie: Arc<TokenTrie>,
    eos_token_ids: Vec<u32>,
    cache: Mutex<HashMap<StateID, Arc<AllowedTokens>>>,
}

impl Grammar {
    /// Compiles `pattern` (regex-syntax dialect, Unicode on) so that its full matches, and only
    /// those, can be generated. `size_limit_bytes` bounds each of the NFA, the determiniser's
    /// working memory and the DFA.
    pub fn new(
        pattern: &str,
        trie: Arc<TokenTrie>,
        eos_token_ids: &[u32],
        size_limit_bytes: usize,
    ) -> Result<Grammar, GuidedError> {
        if let Some(&bad) = eos_token_ids
            .iter()
            .find(|&&t| t as usize >= trie.vocab_size())
        {
            return Err(GuidedError::BadToken(format!(
                "end-of-sequence token {bad} is outside the vocabulary of {}",
                trie.vocab_size()
            )));
        }
        let syntax_config = syntax::Config::new().nest_limit(NEST_LIMIT);
        // Parsed alone first, so that a syntax error quotes the caller's pattern as written.
        let hir = parse_ascii_perl(pattern)
            .map_err(|e| GuidedError::BadPattern(format!("invalid pattern: {e}")))?;
        // `(?:RE)$` built on the syntax tree, not as text: a trailing `# comment` of a
        // `(?x)` pattern would swallow a textual `)$`.
        let anchored = Hir::concat(vec![hir, Hir::look(Look::End)]);
        let too_large_or_bad = |msg: String| {
            if msg.contains("exceed") {
                GuidedError::TooLarge(format!(
                    "the pattern's automaton is larger than {} MiB: {msg}",
                    size_limit_bytes >> 20
                ))
            } else {
                GuidedError::BadPattern(format!("invalid pattern: {msg}"))
            }
        };
        let nfa = thompson::Compiler::new()
            .syntax(syntax_config)
            .configure(
                thompson::Config::new()
                    .nfa_size_limit(Some(size_limit_bytes))
                    .which_captures(thompson::WhichCaptures::None),
            )
            .build_from_hir(&anchored)
            .map_err(|e| too_large_or_bad(error_chain(&e)))?;
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(size_limit_bytes))
                    .determinize_size_limit(Some(size_limit_bytes)),
            )
            .build_from_nfa(&nfa)
            .map_err(|e| too_large_or_bad(error_chain(&e)))?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| GuidedError::BadPattern(format!("the pattern has no start state: {e}")))?;
        let mut eos = eos_token_ids.to_vec();
        eos.sort_unstable();
        eos.dedup();
        Ok(Grammar {
            dfa,
            start,
            trie,
            eos_token_ids: eos,
            cache: Mutex::new(HashMap::new()),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.trie.vocab_size()
    }

    /// Bytes held by the DFA (the mask cache not included).
    pub fn dfa_memory_bytes(&self) -> usize {
        self.dfa.memory_usage()
    }

    /// How many states have their allowed tokens cached.
    pub fn num_cached_states(&self) -> usize {
        self.cache.lock().len()
    }

    fn step(&self, state: StateID, bytes: &[u8]) -> Option<StateID> {
        let mut s = state;
        for &b in bytes {
            s = self.dfa.next_state(s, b);
            if self.dfa.is_dead_state(s) {
                return None;
            }
        }
        Some(s)
    }

    fn is_accepting(&self, state: StateID) -> bool {
        self.dfa.is_match_state(self.dfa.next_eoi_state(state))
    }

    /// True when `text` is a full match (a test helper and a check for callers).
    pub fn matches(&self, text: &[u8]) -> bool {
        self.step(self.start, text)
            .is_some_and(|s| self.is_accepting(s))
    }

    /// The tokens allowed in `state`, computed on first use and cached.
    fn allowed(&self, state: StateID) -> Arc<AllowedTokens> {
        if let Some(hit) = self.cache.lock().get(&state) {
            return Arc::clone(hit);
        }
        let computed = Arc::new(self.compute_allowed(state));
        let mut cache = self.cache.lock();
        if cache.len() >= MAX_CACHED_STATES && !cache.contains_key(&state) {
            cache.clear(); // rare: the states in use are recomputed on their next visit
        }
        Arc::clone(cache.entry(state).or_insert(computed))
    }

    fn compute_allowed(&self, state: StateID) -> AllowedTokens {
        let trie = &self.trie;
        let mut words = vec![0u64; trie.vocab_size().div_ceil(64)];
        let mut count = 0usize;
        let mut set = |id: u32, words: &mut Vec<u64>| {
            let (w, b) = (id as usize / 64, id % 64);
            if words[w] >> b & 1 == 0 {
                words[w] |= 1 << b;
                count += 1;
            }
        };
        // Depth-first over (trie node, DFA state); the root has no tokens (no empty token).
        let mut stack: Vec<(u32, StateID)> = vec![(0, state)];
        while let Some((node, s)) = stack.pop() {
            for &(byte, child) in trie.edges_of(node as usize) {
                let next = self.dfa.next_state(s, byte);
                if self.dfa.is_dead_state(next) {
                    continue;
                }
                for &id in trie.tokens_of(child as usize) {
                    set(id, &mut words);
                }
                stack.push((child, next));
            }
        }
        let accepting = self.is_accepting(state);
        if accepting {
            for &id in &self.eos_token_ids {
                set(id, &mut words);
            }
        }
        AllowedTokens {
            words,
            count,
            accepting,
        }
    }
}

/// One sequence's position in a grammar.
#[derive(Clone)]
pub struct GuidedSequence {
    grammar: Arc<Grammar>,
    state: StateID,
    /// Set once an end-of-sequence token was accepted: nothing may follow.
    finished: bool,
}

impl GuidedSequence {
    pub fn new(grammar: Arc<Grammar>) -> GuidedSequence {
        let state = grammar.start;
        GuidedSequence {
            grammar,
            state,
            finished: false,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.grammar.vocab_size()
    }

    /// The tokens allowed next (nothing once finished).
    pub fn allowed_tokens(&self) -> Arc<AllowedTokens> {
        if self.finished {
            return Arc::new(AllowedTokens {
                words: vec![0; self.grammar.vocab_size().div_ceil(64)],
                count: 0,
                accepting: true,
            });
        }
        self.grammar.allowed(self.state)
    }

    /// The output so far is a full match.
    pub fn is_accepting(&self) -> bool {
        self.finished || self.grammar.is_accepting(self.state)
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Moves past `token_id`; false (state unchanged) when the token is not allowed here.
    pub fn advance(&mut self, token_id: usize) -> bool {
        if self.finished || token_id >= self.grammar.vocab_size() {
            return false;
        }
        if self
            .grammar
            .eos_token_ids
            .binary_search(&(token_id as u32))
            .is_ok()
        {
            if self.grammar.is_accepting(self.state) {
                self.finished = true;
                return true;
            }
            return false;
        }
        let bytes = self.grammar.trie.bytes_of(token_id);
        if bytes.is_empty() {
            return false;
        }
        match self.grammar.step(self.state, bytes) {
            Some(next) => {
                self.state = next;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: every single byte of interest, some multi-byte tokens, a special token
    /// (empty) and an EOS id past the byte tokens.
    fn toy() -> (Arc<TokenTrie>, Vec<Vec<u8>>, u32) {
        let mut tokens: Vec<Vec<u8>> = Vec::new();
        for b in b"{}\":, abcxyz0123456789-.tfruels[]n" {
            assert!(
                !tokens.contains(&vec![*b]),
                "toy vocabulary: byte {b} listed twice"
            );
            tokens.push(vec![*b]);
        }
        for t in [
            "\"a\"", "{\"", "\":", "true", "false", "null", "12", "ab", "abc", "\"}", "é",
        ] {
            tokens.push(t.as_bytes().to_vec());
        }
        tokens.push(vec![0xC3]); // the first byte of a 2-byte UTF-8 character
        tokens.push(vec![0xA9]); // a continuation byte (é = C3 A9)
        tokens.push(Vec::new()); // special
        let eos = tokens.len() as u32;
        tokens.push(Vec::new()); // EOS has no bytes
        let trie = Arc::new(TokenTrie::new(&tokens, tokens.len() + 3).unwrap());
        (trie, tokens, eos)
    }

    fn grammar(pattern: &str) -> (Arc<Grammar>, Vec<Vec<u8>>, u32) {
        let (trie, tokens, eos) = toy();
        (
            Arc::new(Grammar::new(pattern, trie, &[eos], DEFAULT_SIZE_LIMIT_BYTES).unwrap()),
            tokens,
            eos,
        )
    }

    /// The brute-force definition of allowed: some full match starts with prefix + token bytes.
    fn brute_allowed(g: &Grammar, prefix: &[u8], tokens: &[Vec<u8>], eos: u32) -> Vec<u32> {
        let mut out = Vec::new();
        for (id, t) in tokens.iter().enumerate() {
            if id as u32 == eos {
                if g.matches(prefix) {
                    out.push(id as u32);
                }
                continue;
            }
            if t.is_empty() {
                continue;
            }
            let mut text = prefix.to_vec();
            text.extend_from_slice(t);
            if g.step(g.start, &text).is_some() {
                out.push(id as u32);
            }
        }
        out
    }

    #[test]
    fn perl_classes_are_ascii_inside_and_outside_brackets() {
        let digit = "\u{1FBF8}"; // SEGMENTED DIGIT EIGHT: Unicode Nd, four bytes
        let arabic = "\u{0663}"; // ARABIC-INDIC DIGIT THREE
        for (pattern, yes, no) in [
            (
                r"\d{2}",
                vec!["07"],
                vec![format!("0{digit}"), format!("{arabic}1")],
            ),
            (r"[\d_]+", vec!["1_2"], vec![digit.to_string()]),
            (
                r"\w+",
                vec!["a_Z9"],
                vec!["é".to_string(), digit.to_string()],
            ),
            (r"\s", vec![" ", "\t"], vec!["\u{00A0}".to_string()]),
            (r"\D", vec!["é", "x"], vec!["5".to_string()]),
            (
                r"[^\W\d]+",
                vec!["ab_"],
                vec!["a1".to_string(), "é".to_string()],
            ),
            (r"[a-z&&\w]", vec!["q"], vec!["Q".to_string()]),
            (r"\p{Nd}", vec!["5", digit], vec!["x".to_string()]), // Unicode when asked for
        ] {
            let (g, _, _) = grammar(pattern);
            for text in yes {
                assert!(
                    g.matches(text.as_bytes()),
                    "{pattern} should match {text:?}"
                );
            }
            for text in no {
                assert!(
                    !g.matches(text.as_bytes()),
                    "{pattern} should not match {text:?}"
                );
            }
        }
        // a syntax error still quotes the pattern as written
        let (trie, _, eos) = toy();
        let err = Grammar::new(r"\d(", trie, &[eos], DEFAULT_SIZE_LIMIT_BYTES)
            .err()
            .unwrap();
        assert!(err.to_string().contains(r"\d("), "{err}");
    }

    #[test]
    fn allowed_tokens_equal_the_brute_force_definition_along_a_walk() {
        let (g, tokens, eos) = grammar(r#"\{"a":(?:true|false|null|-?[0-9]{1,3})\}"#);
        let mut seq = GuidedSequence::new(Arc::clone(&g));
        let text = br#"{"a":-12}"#;
        // walk byte by byte, checking the allowed set at every prefix
        for i in 0..=text.len() {
            let allowed = seq.allowed_tokens();
            assert_eq!(
                allowed.ids(),
                brute_allowed(&g, &text[..i], &tokens, eos),
                "prefix {i}"
            );
            assert_eq!(allowed.count, allowed.ids().len());
            if i < text.len() {
                let id = tokens.iter().position(|t| t == &vec![text[i]]).unwrap();
                assert!(allowed.contains(id));
                assert!(seq.advance(id));
            }
        }
        assert!(seq.is_accepting());
        let allowed = seq.allowed_tokens();
        assert_eq!(
            allowed.ids(),
            vec![eos],
            "only EOS may end a complete match"
        );
        assert!(seq.advance(eos as usize));
        assert!(seq.is_finished());
        assert_eq!(seq.allowed_tokens().count, 0);
        assert!(!seq.advance(eos as usize));
    }

    #[test]
    fn multi_byte_tokens_and_partial_utf8_are_walked_byte_by_byte() {
        let (g, tokens, eos) = grammar("(?:ab|é)+");
        let seq = GuidedSequence::new(Arc::clone(&g));
        let ids = seq.allowed_tokens().ids();
        let text = |id: &u32| tokens[*id as usize].clone();
        let mut got: Vec<Vec<u8>> = ids.iter().map(text).collect();
        got.sort();
        let mut want = vec![
            b"a".to_vec(),
            b"ab".to_vec(),
            "é".as_bytes().to_vec(),
            vec![0xC3],
        ];
        want.sort();
        assert_eq!(got, want);
        let mut s = seq.clone();
        let c3 = tokens.iter().position(|t| t == &vec![0xC3]).unwrap();
        let a9 = tokens.iter().position(|t| t == &vec![0xA9]).unwrap();
        assert!(s.advance(c3));
        assert!(!s.is_accepting());
        assert_eq!(s.allowed_tokens().ids(), vec![a9 as u32]);
        assert!(s.advance(a9));
        assert!(s.is_accepting());
        assert!(s.allowed_tokens().contains(eos as usize));
        assert_eq!(
            brute_allowed(&g, "é".as_bytes(), &tokens, eos),
            s.allowed_tokens().ids()
        );
    }

    #[test]
    fn disallowed_tokens_leave_the_state_unchanged() {
        let (g, tokens, eos) = grammar("ab");
        let mut s = GuidedSequence::new(g);
        let b = tokens.iter().position(|t| t == b"b").unwrap();
        let special = tokens.iter().position(|t| t.is_empty()).unwrap();
        assert!(!s.advance(b));
        assert!(!s.advance(special));
        assert!(!s.advance(eos as usize), "EOS before the match is complete");
        assert!(!s.advance(10_000), "an id past the vocabulary");
        let before = s.allowed_tokens();
        let ab = tokens.iter().position(|t| t == b"ab").unwrap();
        assert!(before.contains(ab));
        assert!(s.advance(ab));
        assert!(s.is_accepting());
    }

    #[test]
    fn a_full_match_is_only_recognised_at_the_end() {
        let (g, _, _) = grammar("a|ab");
        assert!(g.matches(b"a"));
        assert!(g.matches(b"ab"));
        assert!(!g.matches(b"abc"));
        assert!(!g.matches(b""));
        // "a" is accepting and can still be extended: both EOS and "b" are allowed there.
        let (trie, tokens, eos) = toy();
        let g = Arc::new(Grammar::new("a|ab", trie, &[eos], DEFAULT_SIZE_LIMIT_BYTES).unwrap());
        let mut s = GuidedSequence::new(g);
        assert!(s.advance(tokens.iter().position(|t| t == b"a").unwrap()));
        let allowed = s.allowed_tokens();
        assert!(allowed.accepting);
        assert!(allowed.contains(eos as usize));
        assert!(allowed.contains(tokens.iter().position(|t| t == b"b").unwrap()));
    }

    #[test]
    fn mask_matches_ids_and_cache_is_reused() {
        let (g, _, _) = grammar("[a-c]+");
        let s = GuidedSequence::new(Arc::clone(&g));
        let allowed = s.allowed_tokens();
        let mut mask = vec![false; g.vocab_size()];
        allowed.write_mask(&mut mask);
        let from_mask: Vec<u32> = mask
            .iter()
            .enumerate()
            .filter(|(_, &m)| m)
            .map(|(i, _)| i as u32)
            .collect();
        assert_eq!(from_mask, allowed.ids());
        assert_eq!(g.num_cached_states(), 1);
        let again = s.allowed_tokens();
        assert!(Arc::ptr_eq(&allowed, &again));
        assert_eq!(g.num_cached_states(), 1);
    }

    #[test]
    fn the_mask_cache_stays_bounded_and_correct() {
        // [0-9]{n} has n + 1 states on the walk; go well past the cap
        let n = MAX_CACHED_STATES + 500;
        let (g, tokens, eos) = grammar(&format!("[0-9]{{{n}}}"));
        let digit = tokens.iter().position(|t| t == b"7").unwrap();
        let mut s = GuidedSequence::new(Arc::clone(&g));
        for i in 0..n {
            let allowed = s.allowed_tokens();
            assert!(
                allowed.contains(digit) && !allowed.contains(eos as usize),
                "step {i}"
            );
            assert!(g.num_cached_states() <= MAX_CACHED_STATES);
            assert!(s.advance(digit));
        }
        assert_eq!(s.allowed_tokens().ids(), vec![eos]);
    }

    #[test]
    fn a_verbose_pattern_ending_in_a_comment_is_anchored_at_the_end() {
        // `(?x)` comments run to the end of the line: the anchoring must not be text after it
        let (g, _, _) = grammar("(?x) ab  c+ # letters");
        assert!(g.matches(b"abcc") && !g.matches(b"abccx") && !g.matches(b"ab"));
        let (g, _, _) = grammar("a|b");
        assert!(g.matches(b"a") && g.matches(b"b") && !g.matches(b"ab"));
    }

    #[test]
    fn bad_patterns_and_oversized_automata_are_refused() {
        let (trie, _, eos) = toy();
        let err = |p: &str, limit: usize| {
            Grammar::new(p, Arc::clone(&trie), &[eos], limit)
                .err()
                .expect("should fail")
        };
        match err("(unclosed", DEFAULT_SIZE_LIMIT_BYTES) {
            GuidedError::BadPattern(m) => {
                assert!(
                    m.contains("(unclosed") && !m.contains("(?:"),
                    "quotes the pattern: {m}"
                )
            }
            e => panic!("{e:?}"),
        }
        assert!(matches!(
            err(r"a\b", DEFAULT_SIZE_LIMIT_BYTES),
            GuidedError::BadPattern(_)
        ));
        let e = err("[a-z]{1000}[0-9]{1000}", 1 << 16);
        assert!(matches!(e, GuidedError::TooLarge(_)), "{e:?}");
        assert!(matches!(
            Grammar::new("a", Arc::clone(&trie), &[100_000], DEFAULT_SIZE_LIMIT_BYTES),
            Err(GuidedError::BadToken(_))
        ));
        assert!(TokenTrie::new(&vec![vec![1u8]; 4], 3).is_err());
    }
}
