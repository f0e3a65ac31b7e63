"""Session 26's A/B of guided decoding's JSON string character: before (any `\\uXXXX`) and after
(a BMP escape, or a surrogate pair as one character). Compile time and DFA bytes of a few
schemas, the two characters alternating in one process (HISTORY.md has the table).

    PYTHONPATH=python python benches/results/cpu/guided_surrogate_pairs_ab_session26.py
"""

from __future__ import annotations

import statistics
import time

import ferrobatch.guided.json_schema as js
from ferrobatch._scheduler import GuidedGrammar, TokenVocab
from ferrobatch.model.loader import _load_gguf_tokenizer, smollm2_gguf_path

OLD = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
NEW = js._STRING_CHAR
LIMIT = 32 << 20
SCHEMAS = {
    "person": {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                    "maxItems": 3}}},
    "20 strings": {"type": "object",
                   "properties": {f"s{i}": {"type": "string"} for i in range(20)}},
    "8 bounded": {"type": "object", "required": [f"s{i}" for i in range(8)],
                  "properties": {f"s{i}": {"type": "string", "maxLength": 64} for i in range(8)}},
}


def use(char: str) -> None:
    js._STRING_CHAR = char
    js._STRING = f'"{char}*"'


def compile_once(vocab, schema) -> tuple[float, int]:
    regex = js.schema_to_regex(schema)
    t = time.perf_counter()
    grammar = GuidedGrammar(regex, vocab, [2], LIMIT)
    return time.perf_counter() - t, grammar.dfa_memory_bytes


def main() -> None:
    tok = _load_gguf_tokenizer(smollm2_gguf_path())
    vocab = TokenVocab(list(tok.token_byte_table(True)), 49152)
    arms = (("old", OLD), ("new", NEW))
    res: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for rnd in range(3):
        for name, schema in SCHEMAS.items():
            for tag, char in arms if rnd % 2 == 0 else arms[::-1]:
                use(char)
                res.setdefault((name, tag), []).append(compile_once(vocab, schema))
    for name in SCHEMAS:
        old, new = res[(name, "old")], res[(name, "new")]
        print(f"{name:12s} compile old {statistics.median(x for x, _ in old) * 1e3:7.1f} ms  "
              f"new {statistics.median(x for x, _ in new) * 1e3:7.1f} ms  "
              f"dfa old {old[0][1] / 1e3:.0f} kB new {new[0][1] / 1e3:.0f} kB")
    for n in (256, 1024):
        schema = {"type": "object", "required": ["a"],
                  "properties": {"a": {"type": "string", "maxLength": n}}}
        for tag, char in arms:
            use(char)
            dt, size = compile_once(vocab, schema)
            print(f"maxLength {n} {tag}: compile {dt * 1e3:.0f} ms, dfa {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
