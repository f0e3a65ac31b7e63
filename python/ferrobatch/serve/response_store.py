"""The Responses API's store (`serve --enable-response-store`): finished responses kept in
memory, so that `previous_response_id` continues a conversation without the client sending it
again, and `GET` / `DELETE /v1/responses/{id}` find them (and `GET
/v1/responses/{id}/input_items` the items its `input` held).

Each stored response keeps its response object (what `GET` returns) and its conversation in
chat shape: the messages it was generated from, without its `instructions` (as OpenAI, a
response's instructions do not carry over to the next), then its own output as an assistant
turn (its text and function calls; its reasoning is dropped, as chat templates drop past
reasoning). A request with `previous_response_id` is generated from that conversation, its own
`instructions` first and its `input` after.

Memory stays bounded: at most `max_responses` responses, the least recently stored or used
going first. Nothing survives a restart. Only the asyncio thread touches the store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_RESPONSES = 1024


@dataclass
class StoredResponse:
    """One finished response: the object `GET` returns and the conversation it ends."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]] = field(default_factory=list)   # its `input`, as items


class ResponseStore:
    """Finished responses by id, least recently used evicted past `max_responses`."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError("the response store must hold at least one response")
        self.max_responses = max_responses
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            input_items: list[dict[str, Any]] | None = None) -> None:
        self._items[response["id"]] = StoredResponse(response, conversation,
                                                     list(input_items or ()))
        self._items.move_to_end(response["id"])
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)
            self.evicted += 1

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def assistant_turn(text: str | None, calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A response's output as the chat template's assistant message."""
    turn: dict[str, Any] = {"role": "assistant", "content": text or ""}
    if calls:
        turn["tool_calls"] = [dict(c) for c in calls]
    return turn
