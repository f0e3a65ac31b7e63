"""`ferrobatch batch` (batch.py): OpenAI batch lines answered through the HTTP routes; every
input line gets exactly one output line, errors included."""

from __future__ import annotations

import json

import pytest

from ferrobatch.batch import parse_line, run_batch


def line(custom_id, url="/v1/completions", **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


async def test_every_line_gets_one_answer(fake_server):
    engine = fake_server.engine
    lines = [line(f"c{i}", prompt=f"p{i}", max_tokens=3) for i in range(40)]
    lines += [line("chat", "/v1/chat/completions", max_tokens=4,
                   messages=[{"role": "user", "content": "hi"}]),
              line("resp", "/v1/responses", input="hi", max_output_tokens=2),
              line("score", "/v1/score", text_1="ab", text_2=["ab", "cd"]),
              line("rerank", "/v1/rerank", query="ab", documents=["cd", "ab"]),
              line("bad-body", "/v1/completions", prompt="x", max_tokens=0),
              line("stream", "/v1/completions", prompt="x", stream=True),
              line("audio", "/v1/audio/transcriptions", input="x"),
              "{not json", "", "   ", json.dumps({"custom_id": 7, "url": "/v1/completions"})]
    out = []
    summary = await run_batch(engine, lines, out.append, concurrency=8, progress=False)
    # blank lines are skipped: 49 requests, of which 5 are refused (one by the server)
    assert summary.total == len(out) == 49 and summary.succeeded == 44 and summary.failed == 5
    by_id = {o["custom_id"]: o for o in out if o["custom_id"]}
    for i in range(40):                      # FakeCore echoes its prompt: p{i} -> "p{i}"[:3]
        r = by_id[f"c{i}"]["response"]
        assert r["status_code"] == 200 and r["body"]["choices"][0]["text"] == f"p{i}p"[:3]
        assert r["request_id"] == r["body"]["id"]
    assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"
    assert by_id["resp"]["response"]["body"]["object"] == "response"
    assert abs(by_id["score"]["response"]["body"]["data"][0]["score"] - 1.0) < 1e-6
    assert by_id["rerank"]["response"]["body"]["results"][0]["index"] == 1
    bad = by_id["bad-body"]["response"]
    assert bad["status_code"] == 400 and "max_tokens" in bad["body"]["error"]["message"]
    assert by_id["stream"]["error"]["code"] == "invalid_request"
    assert "url" in by_id["audio"]["error"]["message"]
    assert sum(o["error"] is not None and o["error"]["code"] == "invalid_json" for o in out) == 1
    assert len({o["id"] for o in out}) == len(out)
    await engine.check_idle_clean()
    with pytest.raises(ValueError, match="concurrency"):
        await run_batch(engine, lines, out.append, concurrency=0, progress=False)


def test_line_checks():
    assert parse_line(line("a"))[0]["custom_id"] == "a"
    for bad, message in (("[]", "JSON object"), (json.dumps({"url": "/v1/completions",
                                                             "body": {}}), "custom_id"),
                         (json.dumps({"custom_id": "x", "method": "GET",
                                      "url": "/v1/completions", "body": {}}), "POST"),
                         (json.dumps({"custom_id": "x", "url": "/v1/completions",
                                      "body": []}), "'body'")):
        item, error = parse_line(bad)
        assert item is None and message in error["error"]["message"], bad


def test_the_cli_answers_a_file(tmp_path, smollm2_gguf_path, capsys):
    from ferrobatch.cli import main
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([
        line("q", "/v1/chat/completions", max_tokens=6, temperature=0,
             messages=[{"role": "user", "content": "What is the capital of France?"}]),
        line("r", "/v1/responses", input="Hello", max_output_tokens=3),
        line("e", "/v1/embeddings", input=["Hello", "World"])]) + "\n")
    assert main(["batch", "-i", str(src), "-o", str(dst), "--device", "cpu",
                 "--kv-cache-gb", "0.05"]) == 0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["e", "q", "r"]
    assert all(o["response"]["status_code"] == 200 for o in out)
    vectors = next(o for o in out if o["custom_id"] == "e")["response"]["body"]["data"]
    assert [len(v["embedding"]) for v in vectors] == [576, 576]      # SmolLM2's hidden size
    assert "3 requests, 3 answered, 0 failed" in capsys.readouterr().err
    assert main(["batch", "-i", str(tmp_path / "missing.jsonl"), "-o", str(dst)]) == 2
