"""OpenAI's Files and Batches APIs (`serve --enable-batch-api`, batch_api.py / batch_store.py),
driven by the `openai` SDK as a user's batch script drives OpenAI: upload, create, poll,
download; validation, cancellation, limits, and the server's stop."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import openai
import pytest
from serve_support import sdk_client

BATCH_API = [{"batch_api": True}]


def line(custom_id, url="/v1/completions", **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


async def submit(client, lines, name="in.jsonl"):
    """(the uploaded file, the batch created on it) for `lines` of /v1/completions requests."""
    uploaded = await client.files.create(file=(name, "\n".join(lines).encode()),
                                         purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                        completion_window="24h")
    return uploaded, batch


async def until_ended(client, batch_id, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert asyncio.get_running_loop().time() < deadline, batch.status
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("fake_server", BATCH_API, indirect=True)
async def test_the_sdk_runs_a_batch_end_to_end(fake_server):
    lines = [line(f"c{i}", prompt=f"p{i}", max_tokens=3) for i in range(30)]
    lines.append(line("bad", prompt="x", max_tokens=0))          # the server refuses it: 400
    lines.append(line("urgent", prompt="u", max_tokens=3, priority=-2))
    core = fake_server.engine._core
    priorities, submit = {}, core.submit

    def recording(req_id, ids, p, *args):
        priorities["".join(map(chr, ids))] = p.priority
        return submit(req_id, ids, p, *args)

    core.submit = recording
    async with sdk_client(fake_server) as client:
        uploaded = await client.files.create(file=("in.jsonl", "\n".join(lines).encode()),
                                             purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.filename == "in.jsonl"
        assert uploaded.bytes == len("\n".join(lines).encode())
        batch = await client.batches.create(input_file_id=uploaded.id,
                                            endpoint="/v1/completions",
                                            completion_window="24h", metadata={"job": "t"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "t"}
        done = await until_ended(client, batch.id)
        assert done.status == "completed", done
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (32, 31, 1)
        # a line's own priority is kept; the others run at --batch-priority (1: after live 0s)
        assert priorities.pop("u") == -2 and set(priorities.values()) == {1}
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        assert done.expires_at == done.created_at + 24 * 3600
        out = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text
               .splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted([f"c{i}" for i in range(30)]
                                                              + ["urgent"])
        for o in out:
            if o["custom_id"] == "urgent":
                continue
            body = o["response"]["body"]
            assert o["response"]["status_code"] == 200 and o["error"] is None
            assert body["choices"][0]["text"] == f"p{o['custom_id'][1:]}p"[:3]
        err = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text
               .splitlines()]
        assert [e["custom_id"] for e in err] == ["bad"]
        assert err[0]["response"]["status_code"] == 400
        files = {f.id: f for f in (await client.files.list()).data}
        assert {uploaded.id, done.output_file_id, done.error_file_id} <= set(files)
        assert files[done.output_file_id].purpose == "batch_output"
        listed = await client.batches.list(limit=5)
        assert [b.id for b in listed.data] == [batch.id]
        deleted = await client.files.delete(uploaded.id)
        assert deleted.deleted and deleted.id == uploaded.id
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(uploaded.id)


@pytest.mark.parametrize("fake_server", BATCH_API, indirect=True)
async def test_a_batch_with_a_bad_line_fails_whole_listing_each_by_line(fake_server):
    lines = [line("a", prompt="x", max_tokens=2),
             line("b", "/v1/chat/completions", messages=[{"role": "user", "content": "x"}]),
             "{not json", "",
             line("a", prompt="y", max_tokens=2),
             line("c", prompt="z", max_tokens=2, stream=True)]
    async with sdk_client(fake_server) as client:
        uploaded, batch = await submit(client, lines)
        done = await until_ended(client, batch.id)
        assert done.status == "failed" and done.failed_at and not done.in_progress_at
        errors = {e.line: e.message for e in done.errors.data}
        assert sorted(errors) == [2, 3, 5, 6], errors
        assert "endpoint" in errors[2] and "JSON" in errors[3]
        assert "custom_id" in errors[5] and "stream" in errors[6]
        assert done.output_file_id is None and done.request_counts.total == 0
        _, batch = await submit(client, ["", ""], "e.jsonl")
        done = await until_ended(client, batch.id)
        assert done.status == "failed" and done.errors.data[0].code == "empty_file"
    assert fake_server.engine._core.submitted == 0          # nothing ran


@pytest.mark.parametrize("fake_server", [{"batch_api": True, "batch_concurrency": 2,
                                          "core": {"step_delay_s": 0.01}}], indirect=True)
async def test_cancelling_aborts_what_runs_and_keeps_what_finished(fake_server):
    lines = [line(f"c{i}", prompt="ab", max_tokens=40) for i in range(12)]
    async with sdk_client(fake_server) as client:
        uploaded, batch = await submit(client, lines)
        while (await client.batches.retrieve(batch.id)).request_counts.completed < 2:
            await asyncio.sleep(0.02)
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = await until_ended(client, batch.id)
        assert done.status == "cancelled" and done.cancelling_at and done.cancelled_at
        assert 2 <= done.request_counts.completed < 12
        out = (await client.files.content(done.output_file_id)).text.splitlines()
        assert len(out) == done.request_counts.completed
        again = await client.batches.cancel(batch.id)          # an ended batch stays as it is
        assert again.status == "cancelled"
    # sdk_client checked the engine is idle and clean: the aborted requests were freed


@pytest.mark.parametrize("fake_server", [{"batch_api": True, "batch_max_file_mb": 1}],
                         indirect=True)
async def test_uploads_and_batches_are_checked(fake_server, monkeypatch):
    store = fake_server.server.state.batches
    async with sdk_client(fake_server) as client:
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
        with pytest.raises(openai.APIStatusError) as big:
            await client.files.create(file=("x.jsonl", b"x" * ((1 << 20) + 1)), purpose="batch")
        assert big.value.status_code == 413
        assert os.listdir(store.dir) == []                   # nothing kept of either
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(input_file_id="file-nope", endpoint="/v1/completions",
                                        completion_window="24h")
        ok = await client.files.create(file=("x.jsonl", line("a", prompt="x").encode()),
                                       purpose="batch")
        for fields, param in (({"endpoint": "/v1/audio/speech"}, "endpoint"),
                              ({"completion_window": "1h"}, "completion_window"),
                              ({"metadata": {"a": 1}}, "metadata")):
            body = {"input_file_id": ok.id, "endpoint": "/v1/completions",
                    "completion_window": "24h", **fields}
            with pytest.raises(openai.BadRequestError) as refused:
                await client.batches.create(**body)
            assert refused.value.body["param"] == param
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_nope")
        # a name is only shown: quotes and control characters are dropped
        # (the SDK percent-encodes a name; a raw client's reaches the store as sent)
        chunks = iter([b"{}", b""])

        async def read_chunk():
            return next(chunks)

        named = await store.add_file('a"b\r\n.jsonl', "batch", read_chunk)
        assert named.filename == "ab.jsonl"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{fake_server.base}/v1/files/{named.id}/content") as r:
                assert r.headers["Content-Disposition"] == 'attachment; filename="ab.jsonl"'
                assert await r.read() == b"{}"
        # the directory holds STORAGE_FILES files' worth (here 2 x 1 MiB) at most
        import ferrobatch.serve.batch_store as batch_store
        monkeypatch.setattr(batch_store, "STORAGE_FILES", 2)
        for _ in range(2):
            await client.files.create(file=("x.jsonl", b"x" * (700 << 10)), purpose="batch")
        with pytest.raises(openai.APIStatusError, match="storage is full") as full:
            await client.files.create(file=("y.jsonl", b"x" * (700 << 10)), purpose="batch")
        assert full.value.status_code == 413
        assert len(os.listdir(store.dir)) == len(store.files)
    async with aiohttp.ClientSession() as s:
        async with s.post(fake_server.base + "/v1/files", json={"purpose": "batch"}) as r:
            assert r.status == 400 and "multipart" in (await r.json())["error"]["message"]
        async with s.get(fake_server.base + "/v1/batches?limit=0") as r:
            assert r.status == 400


def test_a_store_never_used_makes_no_directory():
    from ferrobatch.serve.batch_store import BatchStore

    store = BatchStore()
    assert store._dir is None
    asyncio.run(store.close())
    assert store._dir is None


async def test_without_the_flag_the_routes_say_so(fake_server):
    async with aiohttp.ClientSession() as s:
        for method, path in (("GET", "/v1/batches"), ("GET", "/v1/files"),
                             ("POST", "/v1/batches")):
            async with s.request(method, fake_server.base + path, json={}) as r:
                assert r.status == 404
                assert "--enable-batch-api" in (await r.json())["error"]["message"]


@pytest.mark.parametrize("fake_server", [{"batch_api": True, "api_key": "sk-t",
                                          "core": {"step_delay_s": 0.01}}], indirect=True)
async def test_with_an_api_key_and_a_stop_mid_batch(fake_server):
    import openai as sdk
    client = sdk.AsyncOpenAI(base_url=fake_server.base + "/v1", api_key="sk-t", max_retries=0)
    store = fake_server.server.state.batches
    try:
        lines = [line(f"c{i}", prompt="ab", max_tokens=2) for i in range(4)]
        done = await until_ended(client, (await submit(client, lines))[1].id)
        assert done.status == "completed" and done.request_counts.completed == 4
        long = [line(f"l{i}", prompt="ab", max_tokens=200) for i in range(4)]
        _, running = await submit(client, long, "l.jsonl")
        while store.batch(running.id).status != "in_progress":
            await asyncio.sleep(0.01)
    finally:
        await client.close()
    await fake_server.server.stop()
    assert store.batch(running.id).status == "cancelled"
    assert not os.path.exists(store.dir)
    await fake_server.engine.check_idle_clean(10.0)


@pytest.mark.parametrize("fake_server", [{"batch_api": True, "batch_concurrency": 1,
                                          "core": {"step_delay_s": 0.01}}], indirect=True)
async def test_a_batch_past_its_window_expires_keeping_what_finished(fake_server, monkeypatch):
    import ferrobatch.serve.batch_store as batch_store

    monkeypatch.setitem(batch_store.COMPLETION_WINDOW_S, "24h", 0.5)   # the window, shortened
    lines = [line(f"c{i}", prompt="ab", max_tokens=10) for i in range(40)]
    async with sdk_client(fake_server) as client:
        uploaded, batch = await submit(client, lines)
        done = await until_ended(client, batch.id)
        assert done.status == "expired" and done.expired_at
        assert 0 < done.request_counts.completed < 40
        out = (await client.files.content(done.output_file_id)).text.splitlines()
        assert len(out) == done.request_counts.completed
