"""`/score` and `/rerank` (FakeCore: its embeddings are `fake_embedding` of the prompt's
characters): the shapes vLLM gives, pairing, ranking, `top_n`, `return_documents`, and the
400s for bad bodies."""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest
from fake_core import fake_embedding


def _cosine(a: str, b: str) -> float:
    x, y = fake_embedding([ord(c) for c in a]), fake_embedding([ord(c) for c in b])
    return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


async def _post(r, path, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(r.base + path, json=body) as resp:
            return resp.status, await resp.json()


async def test_score_pairs_in_vllms_shape(fake_server):
    for path in ("/score", "/v1/score"):
        status, out = await _post(fake_server, path, {"model": "fake", "text_1": "abc",
                                                      "text_2": ["abd", "xyz", "abc"]})
        assert status == 200 and out["object"] == "list" and out["model"] == "fake"
        assert out["id"].startswith("score-")
        assert [d["index"] for d in out["data"]] == [0, 1, 2]
        assert all(d["object"] == "score" for d in out["data"])
        for d, doc in zip(out["data"], ["abd", "xyz", "abc"]):
            assert abs(d["score"] - _cosine("abc", doc)) < 1e-6
        assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == 18
    status, out = await _post(fake_server, "/score", {"text_1": ["ab", "cd"],
                                                      "text_2": ["ab", "dc"]})
    assert status == 200 and abs(out["data"][0]["score"] - 1.0) < 1e-6


async def test_rerank_sorts_and_cuts(fake_server):
    docs = ["xyz", "abd", "abc", "qqq"]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, out = await _post(fake_server, path, {"query": "abc", "documents": docs,
                                                      "top_n": 2})
        assert status == 200 and out["id"].startswith("rerank-")
        want = sorted(range(4), key=lambda i: -_cosine("abc", docs[i]))[:2]
        assert [r["index"] for r in out["results"]] == want
        assert [r["document"]["text"] for r in out["results"]] == [docs[i] for i in want]
        assert out["usage"]["total_tokens"] == 3 * 4 + sum(map(len, docs))
    status, out = await _post(fake_server, "/rerank", {"query": "abc", "documents": docs,
                                                       "return_documents": False})
    assert len(out["results"]) == 4 and all("document" not in r for r in out["results"])
    scores = [r["relevance_score"] for r in out["results"]]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, None),
    ("/score", {"text_1": "a", "text_2": "b", "model": "nope"}, "model"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": "x"},
     "truncate_prompt_tokens"),
    ("/rerank", {"documents": ["a"]}, "query"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/rerank", {"query": "a", "documents": ["a", 3]}, "documents"),
    ("/rerank", {"query": "a", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": "a", "documents": ["a"], "return_documents": 1}, "return_documents"),
    ("/rerank", [1, 2], None),
])
async def test_bad_bodies_are_4xx_naming_the_field(fake_server, path, body, param):
    status, out = await _post(fake_server, path, body)
    assert 400 <= status < 500 and out["error"]["param"] == param
