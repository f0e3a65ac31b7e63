import time, statistics
import ferrobatch.guided.json_schema as js
from ferrobatch.model.loader import smollm2_gguf_path, _load_gguf_tokenizer
from ferrobatch._scheduler import TokenVocab, GuidedGrammar
tok = _load_gguf_tokenizer(smollm2_gguf_path())
vocab = TokenVocab(list(tok.token_byte_table(True)), 49152)
OLD = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
NEW = js._STRING_CHAR
schemas = {
 "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}}, "required": ["name", "age"]},
 "20 strings": {"type": "object", "properties": {f"s{i}": {"type": "string"} for i in range(20)}},
 "8 bounded": {"type": "object", "properties": {f"s{i}": {"type": "string", "maxLength": 64} for i in range(8)}, "required": [f"s{i}" for i in range(8)]},
}
res = {}
for rnd in range(3):
    for name, s in schemas.items():
        for tag, ch in (("old", OLD), ("new", NEW)) if rnd % 2 == 0 else (("new", NEW), ("old", OLD)):
            js._STRING_CHAR = ch
            js._STRING = f'"{ch}*"'
            rx = js.schema_to_regex(s)
            t = time.perf_counter(); g = GuidedGrammar(rx, vocab, [2], 32 << 20); dt = time.perf_counter() - t
            # walk: allowed-token mask inside a string state costs the most
            seq = g.start()
            res.setdefault((name, tag), []).append((dt, g.dfa_memory_bytes))
for name in schemas:
    o = res[(name, "old")]; n = res[(name, "new")]
    print(f"{name:12s} compile old {statistics.median(x for x,_ in o)*1e3:7.1f} ms  new {statistics.median(x for x,_ in n)*1e3:7.1f} ms  dfa old {o[0][1]/1e3:.0f} kB new {n[0][1]/1e3:.0f} kB")
for n in (256, 1024):
    for tag, ch in (("old", OLD), ("new", NEW)):
        js._STRING_CHAR = ch; js._STRING = f'"{ch}*"'
        rx = js.schema_to_regex({"type": "object", "properties": {"a": {"type": "string", "maxLength": n}}, "required": ["a"]})
        t = time.perf_counter()
        try:
            g = GuidedGrammar(rx, vocab, [2], 32 << 20); dt = time.perf_counter() - t
            s = g.start()
            print(f"maxLength {n} {tag}: compile {dt*1e3:.0f} ms, dfa {g.dfa_memory_bytes/1e6:.1f} MB")
        except Exception as e:
            print(f"maxLength {n} {tag}: {type(e).__name__}: {str(e)[:100]}")
