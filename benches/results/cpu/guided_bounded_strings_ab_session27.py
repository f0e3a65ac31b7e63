"""Session 27's A/B of guided decoding's bounded JSON strings (minLength / maxLength): before,
each counted character could also be a `\\uXXXX` escape (or a surrogate pair's two); after, it is
a raw character or a short escape. Compile time and DFA bytes of realistic schemas, the two
characters alternating in one process (HISTORY.md has the table).

    PYTHONPATH=python python benches/results/cpu/guided_bounded_strings_ab_session27.py
"""

from __future__ import annotations

import statistics
import time

import ferrobatch.guided.json_schema as js
from ferrobatch._scheduler import GuidedGrammar, TokenVocab
from ferrobatch.model.loader import _load_gguf_tokenizer, smollm2_gguf_path

OLD = js._STRING_CHAR            # any character, \uXXXX escapes included
NEW = js._BOUNDED_STRING_CHAR
LIMIT = 32 << 20


def s(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": list(required or props)}


SCHEMAS = {
    "person (README)": obj({"name": s(40), "age": {"type": "integer"},
                            "hobbies": {"type": "array", "items": s(30), "maxItems": 3}},
                           ["name", "age"]),
    "one string, maxLength 1024": s(1024),
    "article: 200/500/1000/100 + tags": obj({
        "title": s(200), "summary": s(500), "body": s(1000), "author": s(100),
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10}}),
    "list[Item(100, 300)], maxItems 20": obj({"items": {
        "type": "array", "maxItems": 20, "items": obj({"name": s(100), "desc": s(300)})}}),
    "8 required, maxLength 1000": obj({f"s{i}": s(1000) for i in range(8)}),
    "64 strings of maxLength 200": {"type": "array", "items": s(200), "maxItems": 64},
}


def compile_once(vocab, schema) -> tuple[float, int] | str:
    regex = js.schema_to_regex(schema)
    t = time.perf_counter()
    try:
        grammar = GuidedGrammar(regex, vocab, [2], LIMIT)
    except ValueError as exc:
        return "refused" if "larger than" in str(exc) else str(exc)[:60]
    return time.perf_counter() - t, grammar.dfa_memory_bytes


def main() -> None:
    tok = _load_gguf_tokenizer(smollm2_gguf_path())
    vocab = TokenVocab(list(tok.token_byte_table(True)), 49152)
    arms = (("old", OLD), ("new", NEW))
    for name, schema in SCHEMAS.items():
        res: dict[str, list] = {"old": [], "new": []}
        for rnd in range(3):
            for tag, char in arms if rnd % 2 == 0 else arms[::-1]:
                js._BOUNDED_STRING_CHAR = char
                res[tag].append(compile_once(vocab, schema))
        js._BOUNDED_STRING_CHAR = NEW
        line = f"{name:36s}"
        for tag in ("old", "new"):
            r = res[tag]
            if isinstance(r[0], str):
                line += f" | {tag} {r[0]:>24s}"
            else:
                line += (f" | {tag} {statistics.median(x[0] for x in r) * 1e3:7.0f} ms"
                         f" {r[0][1] / 1e6:6.1f} MB")
        print(line, flush=True)


if __name__ == "__main__":
    main()
