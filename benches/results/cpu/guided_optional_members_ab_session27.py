"""Session 27's A/B of guided decoding's optional object members: before (the members after the
first written one repeated per first member, quadratic text) and after (a run grown from the
front, linear text). Regex characters, compile time and DFA bytes, arms alternating in one process.

    PYTHONPATH=python python benches/results/cpu/guided_optional_members_ab_session27.py
"""

from __future__ import annotations

import statistics
import time

import ferrobatch.guided.json_schema as js
from ferrobatch._scheduler import GuidedGrammar, TokenVocab
from ferrobatch.model.loader import _load_gguf_tokenizer, smollm2_gguf_path

LIMIT = 32 << 20


def old_members(self, members):
    """The quadratic construction this session replaced (session 26's `_members`)."""
    later = first = ""
    for text, needed in reversed(members):
        tail = f",{self.ws}{text}"
        new_later = (tail if needed else f"(?:{tail})?") + later
        if needed:
            first = text + later
        elif first:
            first = f"(?:{text}{later}|{first})"
        else:
            first = f"(?:{text}{later})?"
        later = self._check_size(new_later)
        self._check_size(first)
    return first


def optional_ints(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def tool_like(n: int) -> dict:
    """A function's parameters: two required strings, then n optional mixed ones."""
    props = {"query": {"type": "string"}, "limit": {"type": "integer"}}
    kinds = ({"type": "string"}, {"type": "boolean"}, {"type": "number"},
             {"type": "string", "enum": ["asc", "desc"]}, {"type": ["string", "null"]})
    props |= {f"opt{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "required": ["query", "limit"], "properties": props}


CASES = [(f"{n} optional integers", optional_ints(n)) for n in (10, 20, 40, 60, 80, 150, 300)]
CASES += [(f"2 required + {n} optional", tool_like(n)) for n in (20, 40)]


def compile_once(vocab, schema) -> tuple[int, float, int] | str:
    try:
        regex = js.schema_to_regex(schema)
        t = time.perf_counter()
        grammar = GuidedGrammar(regex, vocab, [2], LIMIT)
        return len(regex), time.perf_counter() - t, grammar.dfa_memory_bytes
    except Exception as e:  # noqa: BLE001 - a refused arm is a result too
        return f"refused: {str(e)[:70]}"


def main() -> None:
    converter = js._Builder
    new = converter._members
    arms = (("old", old_members), ("new", new))
    tok = _load_gguf_tokenizer(smollm2_gguf_path())
    vocab = TokenVocab(list(tok.token_byte_table(True)), 49152)
    for name, schema in CASES:
        res: dict[str, list] = {"old": [], "new": []}
        for rnd in range(3):
            for tag, fn in arms if rnd % 2 == 0 else arms[::-1]:
                converter._members = fn
                res[tag].append(compile_once(vocab, schema))
        converter._members = new
        line = f"{name:26s}"
        for tag in ("old", "new"):
            r = res[tag]
            if isinstance(r[0], str):
                line += f" | {tag} {r[0]}"
            else:
                line += (f" | {tag} {r[0][0]:7d} chars {statistics.median(x[1] for x in r) * 1e3:8.1f} ms"
                         f" dfa {r[0][2] / 1e6:6.2f} MB")
        print(line, flush=True)


if __name__ == "__main__":
    main()
