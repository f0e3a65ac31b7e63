"""Tool calls the model writes on its own as a Python list of calls (tool_choice "auto";
vLLM's `pythonic` parser): Llama 3.2's lightweight models and Llama 4, whose prompt asks for
"[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]",
answer a tool request with the list as the whole reply (Llama 4 between `<|python_start|>` and
`<|python_end|>`):

    [get_weather(city="Paris"), now()]

The list is read with Python's parser (``ast``), never evaluated: each call must name a listed
tool and pass keyword arguments only, each a literal (strings, numbers, booleans, None, lists,
dicts; JSON's true / false / null are read as such too). `split_calls` turns a finished output
into the OpenAI `tool_calls` when the whole reply is such a list (else it is plain content,
unchanged); `PythonicStream` holds a streamed reply that starts with `[` (or the start tag)
and decides at its end; any other reply goes out as it comes. Nothing is guided here.
"""

from __future__ import annotations

import ast
import json
import secrets
from typing import Any

from ferrobatch.serve.llama3_tools import Llama3Stream

START, END = "<|python_start|>", "<|python_end|>"
TEMPLATE_MARK = "func_name1(params_name1=params_value1"
_JSON_NAMES = {"true": True, "false": False, "null": None}


def template_has_pythonic_calls(chat_template: str | None) -> bool:
    """True when the model's chat template asks for a Python list of calls."""
    return bool(chat_template) and TEMPLATE_MARK in chat_template


def _value(node: ast.AST) -> Any:
    """A literal argument (ValueError for anything else: names, calls, operators...)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):            # {**spread}
            raise ValueError("a dict spread is not a literal")
        keys = [_value(k) for k in node.keys]
        if not all(isinstance(k, str | int | float | bool) or k is None for k in keys):
            raise ValueError("dict keys must be plain values")
        return {k if isinstance(k, str) else json.dumps(k): _value(v)
                for k, v in zip(keys, node.values, strict=True)}
    value = ast.literal_eval(node)       # constants, negative numbers; ValueError otherwise
    if isinstance(value, complex | bytes | set):
        raise ValueError("not a JSON value")
    return value


def split_calls(text: str, names: tuple[str, ...],
                complete: bool) -> tuple[str, list[dict[str, Any]]] | None:
    """("", the calls) when `text` is nothing but a list of calls of tools in `names` (in the
    optional start / end tags); None otherwise. `complete` is accepted for the same face as
    the Hermes parser: the list is whole or it is not."""
    body = text.strip()
    if body.startswith(START):
        body = body[len(START):]
        body = body[:-len(END)] if body.rstrip().endswith(END) else body
        body = body.strip().removesuffix(END).strip()
    if not body.startswith("[") or not body.endswith("]"):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) \
                    or node.func.id not in names or node.args \
                    or any(k.arg is None for k in node.keywords):       # **kwargs
                return None
            args = {k.arg: _value(k.value) for k in node.keywords}
            calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                          "function": {"name": node.func.id,
                                       "arguments": json.dumps(args, ensure_ascii=False)}})
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return "", calls


class PythonicStream(Llama3Stream):
    """One choice's streamed deltas (`Llama3Stream`'s face): a reply that starts like a call
    list is held whole and decided at the end; any other goes out as it comes."""

    def starts_calls(self, start: str) -> bool | None:
        if start.startswith("[") or start.startswith(START):
            return True
        return None if START.startswith(start) else False

    def split(self, text: str, complete: bool) -> tuple[str, list[dict[str, Any]]] | None:
        return split_calls(text, self.names, complete)
