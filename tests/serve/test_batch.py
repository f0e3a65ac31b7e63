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


async def test_lines_are_read_as_requests_take_them(fake_server, monkeypatch):
    # A long job never holds more than `concurrency` requests in flight, and reads its input
    # as they finish: by the first answer, only the first chunk of lines has been pulled.
    import ferrobatch.batch as batch

    in_flight = peak = 0
    answer = batch._answer

    async def counting(*args):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await answer(*args)
        finally:
            in_flight -= 1

    monkeypatch.setattr(batch, "_answer", counting)
    pulled = 0

    def source():
        nonlocal pulled
        for i in range(300):
            pulled += 1
            yield line(f"c{i}", prompt="ab", max_tokens=2)

    pulled_at_first = []
    out: list[dict] = []

    def write(o):
        pulled_at_first.append(pulled) if not out else None
        out.append(o)

    summary = await run_batch(fake_server.engine, source(), write, concurrency=5,
                              progress=False)
    assert summary.total == summary.succeeded == len(out) == 300 and pulled == 300
    assert peak == 5 and pulled_at_first[0] <= batch.READ_CHUNK
    assert sorted(o["custom_id"] for o in out) == sorted(f"c{i}" for i in range(300))


@pytest.mark.parametrize("hold", [1, 64])
async def test_in_order_writes_the_answers_in_the_inputs_order(fake_server, monkeypatch, hold):
    # the first line runs longest, so every other answer is ready before it; held answers are
    # capped (HOLD_PER_SLOT * concurrency: here 2 or 128), the reading waits below the cap
    import ferrobatch.batch as batch

    monkeypatch.setattr(batch, "HOLD_PER_SLOT", hold)
    lines = [line(f"c{i}", prompt="xy", max_tokens=60 if i == 0 else 2) for i in range(30)]
    lines.insert(7, "{bad")                      # an error line keeps its place too
    out: list[dict] = []
    summary = await run_batch(fake_server.engine, lines, out.append, concurrency=2,
                              progress=False, in_order=True)
    assert summary.total == 31 and summary.succeeded == 30
    ids = [o["custom_id"] for o in out]
    assert ids == [f"c{i}" for i in range(7)] + [None] + [f"c{i}" for i in range(7, 30)]
    assert out[0]["response"]["body"]["usage"]["completion_tokens"] == 60
    # without in_order, a short one comes out before the long first line
    out.clear()
    await run_batch(fake_server.engine, lines, out.append, concurrency=2, progress=False)
    assert out[0]["custom_id"] != "c0" and len(out) == 31


async def test_a_reused_custom_id_and_an_earlier_runs_answers(fake_server):
    lines = [line("a", prompt="p1", max_tokens=2), line("b", prompt="p2", max_tokens=2),
             line("a", prompt="p3", max_tokens=2), line("c", prompt="p4", max_tokens=2)]
    out: list[dict] = []
    summary = await run_batch(fake_server.engine, lines, out.append, progress=False,
                              answered={"b"})
    assert (summary.total, summary.succeeded, summary.failed, summary.skipped) == (3, 2, 1, 1)
    by_id = {}
    for o in out:
        by_id.setdefault(o["custom_id"], []).append(o)
    assert "b" not in by_id and by_id["c"][0]["response"]["status_code"] == 200
    first, again = sorted(by_id["a"], key=lambda o: o["error"] is not None)
    assert first["response"]["body"]["choices"][0]["text"] == "p1"
    assert again["response"] is None and again["error"]["code"] == "duplicate_custom_id"


def test_kept_answers_keeps_the_200s_once_each(tmp_path):
    from ferrobatch.batch import kept_answers

    def answer(custom_id, status):
        return json.dumps({"id": "x", "custom_id": custom_id, "error": None,
                           "response": {"status_code": status, "body": {}}})

    path = tmp_path / "out.jsonl"
    assert kept_answers(str(path)) == set() and not path.exists()
    path.write_text("\n".join([
        answer("a", 200), answer("b", 400), answer("a", 200),
        json.dumps({"id": "y", "custom_id": None, "response": None, "error": {"code": "x"}}),
        json.dumps({"id": "z", "custom_id": "c", "response": None, "error": {"code": "x"}}),
        answer("d", 200), '{"id": "w", "custom_id": "e", "resp']))     # cut short by a stop
    assert kept_answers(str(path)) == {"a", "d"}
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert [k["custom_id"] for k in kept] == ["a", "d"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


async def test_without_a_terminal_progress_is_a_line_now_and_then(fake_server, monkeypatch,
                                                                  capsys):
    import ferrobatch.batch as batch

    monkeypatch.setattr(batch, "PROGRESS_LINE_S", 0.0)
    lines = [line(f"c{i}", prompt="ab", max_tokens=2) for i in range(3)]
    await run_batch(fake_server.engine, lines, lambda o: None, progress="lines", total=3)
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("ferrobatch batch: 3/3 (100 %) lines done"), err


def test_run_batch_vllms_command_answers_in_order_and_resumes(tmp_path, smollm2_gguf_path,
                                                              capsys):
    from ferrobatch.cli import main
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    asks = [line(f"q{i}", "/v1/completions", prompt=f"{i} + {i} =", temperature=0,
                 max_tokens=12 if i == 0 else 2) for i in range(6)]
    src.write_text("\n".join(asks) + "\n")
    args = ["--device", "cpu", "--kv-cache-gb", "0.05"]
    assert main(["run-batch", "--input-file", str(src), "--output-file", str(dst)] + args) == 0
    first = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in first] == [f"q{i}" for i in range(6)]
    assert all(o["response"]["status_code"] == 200 for o in first)
    # an interrupted run: two answers kept, one cut short; --resume answers the other four
    dst.write_text("\n".join(json.dumps(o) for o in first[:2]) + "\n" + "{\"id\": \"b")
    assert main(["batch", "-i", str(src), "-o", str(dst), "--resume"] + args) == 0
    again = [json.loads(x) for x in dst.read_text().splitlines()]
    assert sorted(o["custom_id"] for o in again) == [f"q{i}" for i in range(6)]
    assert again[:2] == first[:2]
    texts = {o["custom_id"]: o["response"]["body"]["choices"][0]["text"] for o in again}
    assert texts == {o["custom_id"]: o["response"]["body"]["choices"][0]["text"]
                     for o in first}                                  # greedy: the same text
    assert "4 requests, 4 answered, 0 failed, 2 answered before (--resume)" in \
        capsys.readouterr().err
    assert main(["batch", "-i", str(src), "-o", "-", "--resume"]) == 2
    assert "--resume needs an output file" in capsys.readouterr().err


@pytest.mark.parametrize("fake_server", [{"api_key": "sk-b"}], indirect=True)
async def test_the_cli_sends_a_file_to_a_running_server(fake_server, tmp_path, capsys):
    # `batch --url`: no model loads; the lines go to the server (its key sent), in order with
    # --in-order, resumable as a local job
    from ferrobatch import cli

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(line(f"c{i}", prompt=f"p{i}", max_tokens=2 + i % 3)
                             for i in range(12)) + "\n")
    args = ["batch", "-i", str(src), "-o", str(dst), "--url", fake_server.base + "/v1",
            "--api-key", "sk-b", "--in-order", "--concurrency", "4"]
    assert await cli._batch(cli.parse_args(args)) == 0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [f"c{i}" for i in range(12)]
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert "12 requests, 12 answered, 0 failed" in capsys.readouterr().err
    dst.write_text("\n".join(json.dumps(o) for o in out[:5]) + "\n")
    assert await cli._batch(cli.parse_args(args + ["--resume"])) == 0
    assert sorted(json.loads(x)["custom_id"] for x in dst.read_text().splitlines()) == \
        sorted(f"c{i}" for i in range(12))
    assert "7 requests, 7 answered, 0 failed, 5 answered before" in capsys.readouterr().err
    # the wrong key: every line answered with the server's 401, nothing lost
    bad = ["batch", "-i", str(src), "-o", str(tmp_path / "bad.jsonl"), "--url",
           fake_server.base, "--api-key", "nope"]
    assert await cli._batch(cli.parse_args(bad)) == 0
    answers = [json.loads(x) for x in (tmp_path / "bad.jsonl").read_text().splitlines()]
    assert len(answers) == 12 and {a["response"]["status_code"] for a in answers} == {401}
    with pytest.raises(SystemExit):
        cli.parse_args(["batch", "-i", str(src), "-o", "x", "--url", "ftp://h"])
