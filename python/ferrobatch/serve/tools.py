"""Tool calls on the chat route, forced through guided decoding.

A request with `tools` and `tool_choice` "required" or a named function gets its output
constrained to a JSON text that *is* the call: the named function's `parameters` object, or, for
"required", a non-empty array of `{"name": ..., "parameters": {...}}` over the listed tools.
The reply then carries `tool_calls` (with `function.arguments` as a JSON string) instead of
`content`, and `finish_reason` "tool_calls". "none" ignores the tools. "auto" (the default
when tools are sent) lets the model decide, which needs its own tool-call format: for a model
whose chat template writes Hermes `<tool_call>` blocks (Qwen2.5, Hermes, ...) the output is
free and its blocks become the calls (`hermes_tools.py`), and so do a Llama 3 model's JSON
calls (`llama3_tools.py`); for others (SmolLM2) it is refused
with a 400 that says what to send instead. The model sees the tools only if its chat template
renders them; for the forced modes the grammar guarantees a well-formed call either way.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from ferrobatch.serve import hermes_tools, llama3_tools, mistral_tools, pythonic_tools
from ferrobatch.serve.protocol import ProtocolError

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output becomes tool calls."""

    mode: str                       # "named" (one call of `names[0]`), "required" (1+ calls)
    #                                 or "auto" (the model's own calls, if any)
    names: tuple[str, ...]
    schema: dict[str, Any] | None   # what the output is guided by (guided_json); None: "auto"
    parser: str | None = None       # "auto": how the model writes calls (AUTO_PARSERS)

    @property
    def forced(self) -> bool:
        """The output is guided to be the call(s)."""
        return self.mode != "auto"

    @property
    def keeps_special_tokens(self) -> bool:
        """The model's own calls start with a special token (Mistral's `[TOOL_CALLS]`): the
        request's text must keep special tokens for the parser to see them."""
        return not self.forced and self.parser in KEEPS_SPECIAL_TOKENS


# the tool-call formats "auto" understands: name -> (split_calls, its stream class)
AUTO_PARSERS = {"hermes": (hermes_tools.split_calls, hermes_tools.HermesStream),
                "llama3_json": (llama3_tools.split_calls, llama3_tools.Llama3Stream),
                "mistral": (mistral_tools.split_calls, mistral_tools.MistralStream),
                "pythonic": (pythonic_tools.split_calls, pythonic_tools.PythonicStream)}
# formats whose calls start with a special token: their requests keep special tokens in the text
KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})


def template_tool_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template asks its model for, or None."""
    if hermes_tools.template_has_hermes_calls(chat_template):
        return "hermes"
    if llama3_tools.template_has_llama3_calls(chat_template):
        return "llama3_json"
    if mistral_tools.template_has_mistral_calls(chat_template):
        return "mistral"
    if pythonic_tools.template_has_pythonic_calls(chat_template):
        return "pythonic"
    return None


_ROOT_COMBINATORS = frozenset({"$ref", "allOf", "anyOf", "oneOf"})


def _tool_list(tools: Any) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, checking the OpenAI `tools` shape."""
    if not isinstance(tools, list) or not tools:
        raise ProtocolError("'tools' must be a non-empty list", param="tools")
    if len(tools) > MAX_TOOLS:
        raise ProtocolError(f"at most {MAX_TOOLS} tools are allowed", param="tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ProtocolError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                                param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ProtocolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or "
                                "'-'", param="tools")
        if name in out:
            raise ProtocolError(f"tool {name!r} is listed twice", param="tools")
        params = fn.get("parameters")
        if params is None or params == {}:      # no parameters: a call takes an empty object
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise ProtocolError(f"tools[{i}].function.parameters must be a JSON Schema object",
                                param="tools")
        # a call's arguments are always a JSON object (clients json.loads them into a dict)
        if params.get("type", "object") != "object":
            raise ProtocolError(f"tools[{i}].function.parameters must be a JSON Schema of type "
                                "'object'", param="tools")
        if not _ROOT_COMBINATORS & params.keys():    # a root $ref / anyOf says what it is
            params = {**params, "type": "object"}
        out[name] = params
    return out


def _rebase_refs(schema: Any, tool: str, defs: dict[str, Any]) -> Any:
    """`schema` (a tool's parameters) to sit at `#/$defs/<tool>` of a new root: its `$defs` /
    `definitions` go to `#/$defs/<tool>.<name>` and every "#..." `$ref` follows."""

    def ref(target: str) -> str:
        for prefix in ("#/$defs/", "#/definitions/"):
            if target.startswith(prefix):
                return f"#/$defs/{tool}.{target[len(prefix):]}"
        return f"#/$defs/{tool}" + target[1:] if target.startswith("#") else target

    def walk(node: Any, top: bool) -> Any:
        if isinstance(node, list):
            return [walk(x, False) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if top and key in ("$defs", "definitions") and isinstance(value, dict):
                for def_name, sub in value.items():
                    defs[f"{tool}.{def_name}"] = walk(sub, False)
            elif key == "$ref" and isinstance(value, str):
                out[key] = ref(value)
            else:
                out[key] = walk(value, False)
        return out

    return walk(schema, True)


def parse_tools(body: dict[str, Any], parser: str | None = None) -> ToolPlan | None:
    """The request's tool plan, or None when it asks for no tool call. `parser`: how the model
    writes its own calls (a key of AUTO_PARSERS), so "auto" can be served."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise ProtocolError("'functions' / 'function_call' are deprecated: send 'tools' and "
                            "'tool_choice'", param="functions")
    if tools is None:
        if choice not in (None, "none"):
            raise ProtocolError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    listed = _tool_list(tools)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ProtocolError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if parser is not None:
            return ToolPlan("auto", tuple(listed), None, parser)
        raise ProtocolError("tool_choice 'auto' needs a tool-call format this model does not "
                            "have (its chat template asks for no <tool_call> blocks, Llama 3 "
                            "JSON calls or [TOOL_CALLS]; serve --tool-call-parser names one); send "
                            "tool_choice 'required' or {'type': 'function', 'function': "
                            "{'name': ...}} (the call is then guaranteed well-formed), or "
                            "'none'", param="tool_choice")
    if choice == "required":
        # each tool's schema moves under the new root's $defs, its own $defs beside it, and
        # its "#..." references are rewritten to match (pydantic's nested models use them)
        defs: dict[str, Any] = {}
        calls = []
        for name, params in listed.items():
            defs[name] = _rebase_refs(params, name, defs)
            calls.append({"type": "object", "properties": {
                "name": {"const": name}, "parameters": {"$ref": f"#/$defs/{name}"}},
                "required": ["name", "parameters"]})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
        if not parallel:                       # OpenAI: at most one call
            schema["maxItems"] = 1
        return ToolPlan("required", tuple(listed), schema)
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ProtocolError("'tool_choice' must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if fn["name"] not in listed:
        raise ProtocolError(f"tool_choice names {fn['name']!r}, which is not in 'tools'",
                            param="tool_choice")
    return ToolPlan("named", (fn["name"],), listed[fn["name"]])


def tool_calls_of(plan: ToolPlan, text: str,
                  finish_reason: str | None) -> tuple[str, list[dict[str, Any]] | None]:
    """A finished output as (the content to show, its `tool_calls` or None). A forced call
    shows no content; one cut by max_tokens (not a whole call) is content, as is an "auto"
    output with no clean `<tool_call>` blocks."""
    if not plan.forced:
        split_calls = AUTO_PARSERS[plan.parser][0]
        found = split_calls(text, plan.names, complete=finish_reason == "stop")
        return (text, None) if found is None else found
    calls = tool_calls_from_text(plan, text) if finish_reason == "stop" else None
    return ("", calls) if calls else (text, None)


class ToolOutputStream:
    """One streamed choice of a request with a tool plan: `feed` returns the text that can go
    out as content now (a forced call: none, it goes out whole; "auto": the text before any
    `<tool_call>` block), `finish` what is left: (content, the calls or None). `entries` holds
    the logprob entries of the text not sent yet, for the route to send with it."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.entries: list[Any] = []
        self._hermes = None if plan.forced else AUTO_PARSERS[plan.parser][1](plan.names)
        self._held: list[str] = []

    def feed(self, text: str) -> str:
        if self._hermes is not None:
            return self._hermes.feed(text)
        self._held.append(text)
        return ""

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict[str, Any]] | None]:
        if self._hermes is not None:
            return self._hermes.finish(complete=finish_reason == "stop")
        return tool_calls_of(self.plan, "".join(self._held), finish_reason)


def tool_calls_from_text(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """The OpenAI `tool_calls` of a forced call's finished output (None when the text is not a
    whole call, e.g. cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.mode == "named":
        calls = [(plan.names[0], value)]
    else:
        if not isinstance(value, list) or not all(
                isinstance(c, dict) and c.get("name") in plan.names for c in value):
            return None
        calls = [(c["name"], c.get("parameters", {})) for c in value]
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for name, args in calls]
