"""Where tools run: a bounded set of worker threads (async tools on an event loop of their own), each call with a
deadline. A call that raises (anything, ``SystemExit`` included), outlives its deadline or returns something other
than a string ends as an error message, the tool's result; the run goes on. A call past its deadline is given up:
its worker slot is freed for the others, an async tool's coroutine is cancelled, a plain tool's thread is left to
finish on its own (Python cannot stop a thread), and the object whose method it is (an environment) is not handed to
another rollout while it runs (`ToolRunner.busy_owners`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastgrpo.paths import unicode_problem
from fastgrpo.tools.functions import Tool, is_concurrent


@dataclass
class Result:
    """A finished call: ``key`` as submitted, the ``content`` the conversation gets, whether it ``failed``, and the
    ``seconds`` it ran."""

    key: Any
    content: str
    failed: bool
    seconds: float


@dataclass
class _Call:
    key: Any
    tool: Tool
    arguments: dict[str, Any]
    started: float | None = None  # when a worker took it (its deadline runs from then)
    settled: bool = False  # its result (or its timeout) was handed out
    returned: bool = False  # the tool itself has returned (or raised)
    future: Any = None  # an async tool's, cancelled at its deadline


def tool_error(message: str, strict: bool) -> str:
    """A failed call's result as the model reads it: TRL's ``{'error': message}`` (the dict's text), or with
    ``strict`` (the ``strict_tool_calls`` option) fastgrpo's ``error: message``."""
    return f"error: {message}" if strict else str({"error": message})


class ToolRunner:
    """Runs tool calls on at most ``workers`` threads at once, each for at most ``timeout`` seconds, results of at
    most ``max_result_chars`` characters; ``clock`` measures the deadlines (tests give a fake one). A plain tool runs
    one call at a time (an environment's method, one per instance) unless declared
    `fastgrpo.tools.functions.concurrent`: a tool that keeps state sees its calls one after another, as in TRL's
    loop. A result that is not a string is its text, and a tool's exception the result ``{'error': message}``, as in
    TRL's loop; ``strict``: the first is an error too, and errors are worded by fastgrpo (`tool_error`)."""

    def __init__(
        self,
        workers: int = 4,
        timeout: float = 30.0,
        max_result_chars: int = 4000,
        clock: Callable[[], float] = time.monotonic,
        strict: bool = False,
    ):
        self.timeout, self.max_result_chars, self.clock, self.strict = timeout, max_result_chars, clock, strict
        self._slots = threading.Semaphore(workers)
        self._done: queue.Queue[Result] = queue.Queue()
        self._calls: list[_Call] = []
        self._given_up: list[_Call] = []  # past their deadline, maybe still running
        self._lock = threading.Lock()
        self._serial_locks: dict[int, threading.Lock] = {}  # `_serial`'s, by the function or instance they guard
        self._loop: asyncio.AbstractEventLoop | None = None

    def submit(self, key: Any, tool: Tool, arguments: dict[str, Any]) -> None:
        """Run ``tool(**arguments)``; its `Result` comes out of `results` under ``key``."""
        call = _Call(key, tool, arguments)
        with self._lock:
            self._calls.append(call)
        threading.Thread(target=self._work, args=(call,), daemon=True, name=f"tool {tool.name}").start()

    def _serial(self, tool: Tool) -> threading.Lock | None:
        """The lock that lets ``tool`` run one call at a time: one per function, or per instance for an environment's
        method; None for async tools and those declared `concurrent`."""
        if tool.is_async or is_concurrent(tool.function):
            return None
        owner = id(getattr(tool.function, "__self__", tool.function))
        with self._lock:
            return self._serial_locks.setdefault(owner, threading.Lock())

    def _work(self, call: _Call) -> None:
        serial = self._serial(call.tool)
        if serial is not None and not serial.acquire(timeout=self.timeout):  # its earlier call outlived its deadline
            self._slots.acquire()  # `_finish` gives it back
            call.started, call.returned = self.clock(), True
            message = f"{self._late(call.tool)}: it runs one call at a time, and an earlier call still ran"
            self._finish(call, tool_error(message, self.strict), True, 0.0)
            return
        self._slots.acquire()
        call.started = start = self.clock()  # the deadline runs from here: waiting for an earlier call is not in it
        try:
            if call.tool.is_async:
                coroutine = call.tool.function(**call.arguments)
                call.future = asyncio.run_coroutine_threadsafe(coroutine, self._event_loop())
                value = call.future.result()
            else:
                value = call.tool.function(**call.arguments)
            content, failed = self._checked(call.tool, value)
            if self.clock() - start > self.timeout:  # returned late, before `results` checked its deadline
                content, failed = tool_error(self._late(call.tool), self.strict), True
        except BaseException as exc:  # noqa: BLE001 - a tool's failure of any kind is its result
            message = f"{exc}".encode("utf-8", "replace").decode()  # no lone surrogate reaches the tokenizer
            if self.strict:
                message = f"tool {call.tool.name!r} raised {type(exc).__name__}: {message}"
            content, failed = tool_error(message, self.strict), True
        finally:
            if serial is not None:
                serial.release()
        call.returned = True
        self._finish(call, content, failed, self.clock() - start)

    def _checked(self, tool: Tool, value: Any) -> tuple[str, bool]:
        if not isinstance(value, str):
            if self.strict:
                return tool_error(f"tool {tool.name!r} returned {type(value).__name__}, not a string", True), True
            value = str(value)
        if len(value) > self.max_result_chars:
            limit = self.max_result_chars
            return tool_error(
                f"tool {tool.name!r} returned {len(value)} characters, more than {limit}", self.strict
            ), True
        problem = unicode_problem(value)
        if problem is not None:
            return tool_error(f"tool {tool.name!r} returned text that {problem}", self.strict), True
        return value, False

    def _finish(self, call: _Call, content: str, failed: bool, seconds: float) -> None:
        with self._lock:
            if call.settled:  # given up at its deadline: its slot was freed then
                return
            call.settled = True
            self._calls.remove(call)
        self._slots.release()
        self._done.put(Result(call.key, content, failed, seconds))

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True, name="async tools").start()
            return self._loop

    def _late(self, tool: Tool) -> str:
        return f"tool {tool.name!r} did not return within {self.timeout:g} seconds"

    def _expire(self) -> None:
        """Give up the calls past their deadline."""
        now = self.clock()
        with self._lock:
            late = [c for c in self._calls if c.started is not None and now - c.started > self.timeout]
        for call in late:
            message = tool_error(self._late(call.tool), self.strict)
            if call.future is not None:
                call.future.cancel()
            with self._lock:
                self._given_up.append(call)
            self._finish(call, message, True, now - call.started)

    def busy_owners(self) -> set[int]:
        """The ids of the objects (environments) whose method, called as a tool, was given up at its deadline and
        still runs: they are not handed to another rollout."""
        with self._lock:
            self._given_up = [c for c in self._given_up if not c.returned]
            owners = (getattr(c.tool.function, "__self__", None) for c in self._given_up)
            return {id(owner) for owner in owners if owner is not None}

    def results(self, block: bool = False, poll: float = 0.01) -> list[Result]:
        """The calls finished since the last call; ``block``: wait until there is one (checking deadlines every
        ``poll`` seconds)."""
        out: list[Result] = []
        while True:
            self._expire()
            try:
                out.append(self._done.get(block=block and not out, timeout=poll))
            except queue.Empty:
                if out or not block:
                    return out

    def close(self) -> None:
        """Stop the async tools' event loop (calls still running are left to their threads)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
