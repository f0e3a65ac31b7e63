"""StepLoop: the dedicated engine thread.

It runs `core.step()` (schedule -> model -> sampler -> update) back to back while there is work,
sleeps in the intake's `wait_for_work` (GIL released) when there is none, and hands each step's
whole output to the asyncio loop with exactly one `call_soon_threadsafe`. It does no
per-request Python work. Any exception — including a Rust panic, which is a BaseException — is
engine-fatal: it is handed to the loop once and the thread exits (no zombie engine).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

IDLE_WAIT_S = 0.5
IDLE_BACKOFF_S = 0.001


class StepLoop:
    def __init__(self, core: Any, loop: asyncio.AbstractEventLoop,
                 on_step: Callable[[Any], None], on_fatal: Callable[[BaseException], None]) -> None:
        self._core = core
        self._loop = loop
        self._on_step = on_step
        self._on_fatal = on_fatal
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferrobatch-step", daemon=True)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._poke = threading.Event()    # a call or a resume for a paused loop
        # paused: no step runs (calls still do), whatever waits; AsyncEngine.pause_generation
        self.paused = False
        self.num_steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Ask the thread to exit after its current step; returns True once it has."""
        self._stopping.set()
        self._poke.set()
        self._core.wake()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the step thread between two steps (the scheduler is not thread-safe)."""
        fut: Future = Future()
        self._calls.put((fn, fut))
        self._poke.set()
        self._core.wake()
        return fut

    def set_paused(self, paused: bool) -> None:
        """Stops running steps after the current one (calls still run), or starts again."""
        self.paused = paused
        self._poke.set()
        self._core.wake()

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue            # the caller gave up waiting (e.g. a timeout): not run
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                fut.set_exception(exc)

    def _run(self) -> None:
        core, stopping = self._core, self._stopping
        try:
            while not stopping.is_set():
                self._poke.clear()
                self._run_calls()
                if self.paused:
                    self._poke.wait(IDLE_WAIT_S)
                    continue
                if not core.has_unfinished() and not core.wait_for_work(IDLE_WAIT_S):
                    continue
                result = core.step()
                self.num_steps += 1
                if result is not None:
                    self._hand_off(self._on_step, result)
                else:
                    core.wait_for_work(IDLE_BACKOFF_S)   # nothing schedulable yet: don't spin
        except BaseException as exc:  # noqa: BLE001 - a panic must not leave a zombie engine
            self._hand_off(self._on_fatal, exc)

    def _hand_off(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more
