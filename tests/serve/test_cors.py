"""CORS (`serve --allowed-origins`): off by default, preflights answered before auth, the allow
headers on every kind of response to an allowed origin, never on another origin's."""

from __future__ import annotations

import json

import aiohttp
import pytest

from ferrobatch.cli import build_parser
from ferrobatch.serve.cors import parse_origins

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


async def request(r, method, path, headers, body=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, r.base + path, headers=headers, json=body) as resp:
            return resp.status, resp.headers.copy(), await resp.read()


async def test_off_by_default(fake_server):
    status, headers, _ = await request(fake_server, "OPTIONS", "/v1/completions", PREFLIGHT)
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = await request(fake_server, "GET", "/v1/models", {"Origin": PAGE})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


@pytest.mark.parametrize("fake_server", [{"allowed_origins": parse_origins(PAGE),
                                          "api_key": "k"}], indirect=True)
async def test_listed_origin(fake_server):
    # the preflight carries no credentials: answered before the API-key check
    status, headers, body = await request(fake_server, "OPTIONS", "/v1/completions", PREFLIGHT)
    assert status == 204 and body == b""
    assert headers["Access-Control-Allow-Origin"] == PAGE
    assert headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Vary"] == "Origin"
    auth = {"Origin": PAGE, "Authorization": "Bearer k"}
    # a plain answer, a stream and an error all carry the headers (the page can read each)
    status, headers, body = await request(fake_server, "POST", "/v1/completions", auth,
                                          {"prompt": "abc", "max_tokens": 2})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "ab"
    assert headers["Access-Control-Allow-Origin"] == PAGE
    status, headers, body = await request(fake_server, "POST", "/v1/completions", auth,
                                          {"prompt": "abc", "max_tokens": 2, "stream": True})
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert headers["Access-Control-Allow-Origin"] == PAGE
    status, headers, _ = await request(fake_server, "GET", "/v1/models", {"Origin": PAGE})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == PAGE
    # another origin: its preflight is refused, and no answer carries the allow header
    other = dict(PREFLIGHT, Origin="http://evil.example")
    status, headers, body = await request(fake_server, "OPTIONS", "/v1/completions", other)
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert json.loads(body)["error"]["type"] == "permission_error"
    status, headers, _ = await request(fake_server, "GET", "/v1/models",
                                       {"Origin": "http://evil.example",
                                        "Authorization": "Bearer k"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    await fake_server.engine.check_idle_clean()


@pytest.mark.parametrize("fake_server", [{"allowed_origins": parse_origins("*")}],
                         indirect=True)
async def test_any_origin(fake_server):
    status, headers, _ = await request(fake_server, "OPTIONS", "/v1/chat/completions",
                                       dict(PREFLIGHT, Origin="https://a.example"))
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "*"
    status, headers, _ = await request(fake_server, "GET", "/health",
                                       {"Origin": "https://b.example"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    # a request without an Origin (curl, the SDKs) is untouched
    status, headers, _ = await request(fake_server, "GET", "/health", {})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_parse_origins():
    assert parse_origins(None) == frozenset() and parse_origins(" ") == frozenset()
    assert parse_origins("http://localhost:3000/, https://app.example") == \
        {"http://localhost:3000", "https://app.example"}
    assert parse_origins("*") == {"*"}
    for bad in ("localhost:3000", "ftp://x", "http://x/path", "http://"):
        with pytest.raises(ValueError, match="not '\\*' or scheme://host"):
            parse_origins(bad)


def test_cli_flag(capsys):
    a = build_parser().parse_args(["serve", "--allowed-origins", "http://localhost:3000"])
    assert a.allowed_origins == {"http://localhost:3000"}
    assert build_parser().parse_args(["serve"]).allowed_origins is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "localhost:3000"])
    assert "scheme://host" in capsys.readouterr().err
