"""LoraRegistry: which adapters an engine knows, which are loaded in which slot, who holds them.

Invariants (checked by ``check``; asyncio thread only):

- every loaded adapter (by ``lora_int_id``) sits in exactly one slot of ``1..max_loras`` and the
  runner's slots hold exactly the loaded adapters;
- an adapter's ``refs`` counts the unfinished requests running with it; an adapter is evicted
  (its slot reused) only at ``refs == 0``, least recently used first;
- the served names (``--lora-modules``, ``add_served``) map to distinct adapter ids; one id
  means one adapter (the same name and directory) for as long as it is loaded.

Reading an adapter's files is the slow part of loading it (an 8B model's rank-16 adapter is
~130 MB): the engine reads one that is not loaded on a worker thread before its request is
submitted, or while it waits for a slot (``read`` then ``keep_read``), so that putting it into
a slot on the event loop reads nothing; the served ones are loaded at start-up. Only an adapter
dropped from the read-ahead (more than READ_AHEAD_KEPT at once) is read again inline.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferrobatch.engine.errors import LoraSlotsBusyError
from ferrobatch.lora_request import LoRARequest

if TYPE_CHECKING:
    from ferrobatch.model.lora_adapter import LoraAdapter
    from ferrobatch.runtime.lora import LoraSlots


@dataclass
class _Loaded:
    request: LoRARequest
    slot: int
    adapter: LoraAdapter
    refs: int = 0


logger = logging.getLogger(__name__)

READ_AHEAD_KEPT = 8        # adapters read off the event loop and not yet in a slot


class LoraRegistry:
    """Adapters by id, in the runner's ``slots``; ``load`` reads one from its directory."""

    def __init__(self, slots: LoraSlots, load: Callable[[LoRARequest], LoraAdapter]) -> None:
        self.slots = slots
        self._load = load
        self._loaded: OrderedDict[int, _Loaded] = OrderedDict()   # least recently used first
        self.served: dict[str, LoRARequest] = {}
        # adapters read off the event loop for a slot they will take (keep_read), by id
        self._read: OrderedDict[int, tuple[LoRARequest, LoraAdapter]] = OrderedDict()
        self.loads = 0          # adapters put into a slot (evictions make a reload count again)
        self.evictions = 0

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    def read(self, request: LoRARequest) -> LoraAdapter:
        """``request``'s adapter read from its directory (ValueError for a bad one); touches no
        registry state, so it may run on a worker thread."""
        return self._load(request)

    def needs_read(self, request: LoRARequest) -> bool:
        """True when ``request``'s adapter is neither loaded nor read ahead (``keep_read``)."""
        return request.lora_int_id not in self._loaded and request.lora_int_id not in self._read

    def keep_read(self, request: LoRARequest, adapter: LoraAdapter) -> None:
        """Keeps an adapter read ahead (on a worker thread) for its first ``acquire``; at most
        READ_AHEAD_KEPT are kept, the oldest dropped first (it is then read again, inline)."""
        if request.lora_int_id in self._loaded:
            return
        self._read[request.lora_int_id] = (request, adapter)
        self._read.move_to_end(request.lora_int_id)
        while len(self._read) > READ_AHEAD_KEPT:
            self._read.popitem(last=False)

    def acquire(self, request: LoRARequest, adapter: LoraAdapter | None = None) -> int:
        """The slot of ``request``'s adapter, loaded if needed (``adapter``: already read),
        held until ``release``. Raises ValueError (a bad adapter, or an id already used by
        another adapter) or LoraSlotsBusyError (every slot held by running requests)."""
        if not isinstance(request, LoRARequest):
            raise TypeError("lora_request must be a LoRARequest")
        entry = self._loaded.get(request.lora_int_id)
        if entry is not None:
            if (entry.request.lora_name, entry.request.lora_path) != \
                    (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                                 f"{entry.request.lora_name!r} ({entry.request.lora_path}); "
                                 f"give another adapter another id")
            self._loaded.move_to_end(request.lora_int_id)
        else:
            entry = self._load_into_slot(request, adapter)
        entry.refs += 1
        return entry.slot

    def must_queue(self, lora_int_id: int) -> bool:
        """While requests wait for a slot: does a new request for adapter ``lora_int_id`` queue
        behind them? Yes unless its adapter is loaded and not the least recently used one (that
        one is left to drain, so that a slot frees even when every adapter has steady traffic;
        its new requests queue behind the ones waiting)."""
        return lora_int_id not in self._loaded or next(iter(self._loaded)) == lora_int_id

    def release(self, lora_int_id: int) -> None:
        """A request holding adapter ``lora_int_id`` is done with it."""
        entry = self._loaded.get(lora_int_id)
        if entry is None or entry.refs <= 0:
            raise RuntimeError(f"LoRA adapter {lora_int_id} released more often than acquired")
        entry.refs -= 1

    def _load_into_slot(self, request: LoRARequest, adapter: LoraAdapter | None) -> _Loaded:
        used = {e.slot for e in self._loaded.values()}
        free = next((s for s in range(1, self.max_loras + 1) if s not in used), None)
        victim = None
        if free is None:
            victim = next((i for i, e in self._loaded.items() if e.refs == 0), None)
            if victim is None:
                raise LoraSlotsBusyError(
                    f"all {self.max_loras} LoRA slots hold adapters of running requests "
                    f"(max_loras)")
        ahead = self._read.pop(request.lora_int_id, None)
        if adapter is None and ahead is not None and ahead[0] == request:
            adapter = ahead[1]                  # read on a worker thread (keep_read)
        if adapter is None:                  # ValueError for a bad adapter: nothing changed
            adapter = self._load(request)
        if victim is not None:
            gone = self._loaded.pop(victim)
            free = gone.slot
            self.evictions += 1
            logger.info("LoRA adapter %r (id %d) evicted from slot %d: idle, least recently "
                        "used", gone.request.lora_name, victim, free)
        self.slots.put(free, adapter)
        self.loads += 1
        entry = self._loaded[request.lora_int_id] = _Loaded(request, free, adapter)
        logger.info("LoRA adapter %r (id %d) in slot %d: rank %d on %s, %.1f MiB%s",
                    request.lora_name, request.lora_int_id, free, adapter.rank,
                    ", ".join(adapter.modules), adapter.num_bytes / 2**20,
                    f", trained on {adapter.base_model}" if adapter.base_model else "")
        return entry

    def add_served(self, request: LoRARequest, adapter: LoraAdapter | None = None) -> None:
        """Serves ``request``'s adapter under its name (the doors' ``model`` field), loading it
        now (``adapter``: already read) so that a bad adapter fails here. ValueError for a name
        or id already served as another adapter. When every slot is busy it is only
        registered, and loaded by its first request."""
        known = self.served.get(request.lora_name)
        if known is not None and known != request:
            raise ValueError(f"LoRA adapter name {request.lora_name!r} is already served "
                             f"({known.lora_path})")
        for other in self.served.values():
            if other.lora_int_id == request.lora_int_id and other != request:
                raise ValueError(f"lora_int_id {request.lora_int_id} is already served as "
                                 f"{other.lora_name!r}")
        try:
            self.load(request, adapter)
        except LoraSlotsBusyError:
            if adapter is None:
                self.read(request)           # still checked now
        self.served[request.lora_name] = request

    def load(self, request: LoRARequest, adapter: LoraAdapter | None = None) -> None:
        """Loads ``request``'s adapter into a slot now (held by nothing): acquire's errors."""
        self.acquire(request, adapter)
        self.release(request.lora_int_id)

    def remove_served(self, name: str) -> LoRARequest:
        """Stops serving adapter ``name`` (requests running with it finish normally; its slot
        is freed now if none does, else when it is next needed). KeyError if not served."""
        request = self.served.pop(name)
        self.evict(request.lora_int_id)
        return request

    def evict(self, lora_int_id: int) -> bool:
        """Frees adapter ``lora_int_id``'s slot if no running request holds it; True if it
        was loaded and is now gone."""
        entry = self._loaded.get(lora_int_id)
        if entry is None or entry.refs:
            return False
        del self._loaded[lora_int_id]
        self.slots.clear(entry.slot)
        return True

    def next_free_id(self) -> int:
        """An adapter id no served or loaded adapter uses."""
        used = {r.lora_int_id for r in self.served.values()} | set(self._loaded)
        return max(used, default=0) + 1

    @property
    def num_refs(self) -> int:
        """Requests holding an adapter now (0 at idle)."""
        return sum(e.refs for e in self._loaded.values())

    def loaded(self) -> list[dict]:
        """The loaded adapters, least recently used first (stats, /v1/models)."""
        return [{"name": e.request.lora_name, "id": i, "slot": e.slot, "refs": e.refs,
                 "rank": e.adapter.rank, "modules": e.adapter.modules,
                 "bytes": e.adapter.num_bytes} for i, e in self._loaded.items()]

    def check(self) -> None:
        """The invariants above; RuntimeError when broken."""
        slots = [e.slot for e in self._loaded.values()]
        problems = []
        if len(set(slots)) != len(slots) or not all(1 <= s <= self.max_loras for s in slots):
            problems.append(f"slots {slots} are not distinct slots of 1..{self.max_loras}")
        if {e.slot: id(e.adapter) for e in self._loaded.values()} != \
                {s: id(a) for s, a in self.slots.adapters.items()}:
            problems.append("the runner's slots differ from the loaded adapters")
        if any(e.refs < 0 for e in self._loaded.values()):
            problems.append("a negative reference count")
        ids = [r.lora_int_id for r in self.served.values()]
        if len(set(ids)) != len(ids):
            problems.append("two served names share an adapter id")
        if problems:
            raise RuntimeError("LoRA registry broken: " + "; ".join(problems))
