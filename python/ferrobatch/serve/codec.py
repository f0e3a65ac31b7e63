"""Decoding untrusted frames: msgpack with explicit small limits and no ext types, and JSON.

Never pickle. A msgpack ext type (including the timestamp ext) is rejected, map keys must be
strings or integers (strict_map_key), and every container/string length is bounded before any
allocation happens.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack

from ferrobatch.serve.protocol import ProtocolError

MAX_FRAME_BYTES = 1 << 20          # 1 MiB: a long prompt as text or token ids fits easily
MAX_ARRAY_LEN = 1 << 16            # token ids in a prompt (max_model_len is far below this)
MAX_MAP_LEN = 4096                 # map entries: logit_bias (<= 300 by default), JSON Schemas
MAX_STR_LEN = MAX_FRAME_BYTES


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not accepted")


def unpack(data: bytes) -> Any:
    """One msgpack object from one complete frame; ProtocolError on anything unreadable."""
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}", code=413)
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_reject_ext, use_list=True,
            max_str_len=MAX_STR_LEN, max_bin_len=0, max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN, max_ext_len=0)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is the client's
        detail = str(exc)[:120] if isinstance(exc, ValueError) else type(exc).__name__
        raise ProtocolError(f"invalid msgpack frame: {detail} (ext types and binary data "
                            "are not accepted)") from None


_packer_opts = {"use_bin_type": True}


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, **_packer_opts)


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not valid JSON")


def loads_json(text: str | bytes) -> Any:
    """JSON text -> object; ProtocolError on bad JSON (NaN/Infinity included) or deep nesting."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"invalid JSON: {str(exc)[:200]}") from None


def dumps_json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
