"""Guided decoding (structured outputs): a request's output constrained to a JSON Schema, a
regex or a list of choices.

- `json_schema`: a JSON Schema (or a choice list) written as a regular expression;
  its string `pattern`s are rewritten by `string_pattern`, and both write their regex
  text with `regex_text`;
- `compiler`: the regex compiled (in Rust, `rust_scheduler/src/guided.rs`) into a DFA over the
  model's vocabulary, one grammar per distinct pattern, cached;
- the sampler masks each guided row's logits to the tokens its grammar allows
  (`runtime/sampler.py`), and the engine core moves each sequence past the token it sampled
  (`engine/core.py`).
"""
