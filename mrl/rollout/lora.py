"""The rollout side of LoRA RL: which adapter version each request uses (launch flags and config checks:
``mrl.config.lora_engine``).

    router = AdapterRouter()                        # shared by every RolloutManager of the rollout side
    router.set_current("policy@v7", 7, clients)     # after every engine holds v7 (``weight_sync.adapter``)

SGLang (0.5.10 and 0.5.14) cannot update an adapter in place: loading a name that exists is refused, and
``update_weights_*`` never touch adapter buffers. So each policy version is its own adapter,
``policy@v{n}``; new requests name the newest, a request keeps the version it started with, and an old
version is unloaded on an engine once no request of ours uses it there. An unload whose adapter is still
held by a request blocks the engine's LoRA lock until that request ends, and never returns if the request
is paused (retract/in-place): unloads are sent only for adapters idle on that engine, and never while the
rollout side is drained for a weight sync. This module imports neither torch nor SGLang.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Iterable

from mrl.sglang.wire import adapter_version

class AdapterRouter:
    """Which adapter new requests name, and which old versions each engine may unload (rollout side).

    Every manager that shares the engines shares one router, on one event loop: a request counts as a
    user of (engine, adapter) from before it is sent until its answer is back, so an adapter is unloaded
    on an engine only when no request of ours can still hold it there."""

    def __init__(self) -> None:
        self.current: tuple[str, int] | None = None
        """(name, version) of the adapter new requests use; None = the base model (policy version 0)."""
        self._users: Counter = Counter()  # (engine url, adapter name) -> requests in flight
        self._retired: dict[str, set[str]] = {}  # adapter name -> engines that still hold it
        self._clients: dict[str, Any] = {}  # engine url -> EngineClient
        self._held = 0
        self._tasks: set[asyncio.Task] = set()
        self.unloaded: list[tuple[str, str]] = []
        """(engine url, adapter) of every unload done, in order."""
        self.errors: list[str] = []

    def set_current(self, name: str, version: int, clients: Iterable[Any]) -> None:
        """New requests use ``name`` (already loaded on every engine in ``clients``); the previous adapter
        is retired on those engines and unloaded on each once no request uses it there."""
        adapter_version(name)
        for c in clients:
            self._clients[c.url] = c
        old, self.current = self.current, (name, version)
        if old is not None and old[0] != name:
            self._retired[old[0]] = set(self._clients)
        self._retired.pop(name, None)
        self._unload_idle()

    def add_engine(self, client: Any) -> None:
        """An engine that joins (a restarted one) holds only the current adapter."""
        self._clients[client.url] = client

    def acquire(self, url: str) -> tuple[str, int] | None:
        """The adapter a request about to be sent to ``url`` uses (counted until ``release``)."""
        if self.current is not None:
            self._users[(url, self.current[0])] += 1
        return self.current

    def release(self, url: str, adapter: tuple[str, int] | None) -> None:
        if adapter is None:
            return
        key = (url, adapter[0])
        self._users[key] -= 1
        if self._users[key] <= 0:
            del self._users[key]
            self._unload_idle()

    def live(self) -> list[str]:
        """Adapters loaded on some engine as far as the router knows: the current and the retired ones not
        yet unloaded everywhere."""
        return ([self.current[0]] if self.current else []) + sorted(self._retired, key=adapter_version)

    def hold(self) -> None:
        """No unload until ``resume``: the rollout side is drained for a weight sync, engines may be paused."""
        self._held += 1

    def resume(self) -> None:
        self._held = max(0, self._held - 1)
        self._unload_idle()

    def _unload_idle(self) -> None:
        if self._held:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # set_current from outside the loop: the next release or resume does it
            return
        for name, urls in list(self._retired.items()):
            for url in list(urls):
                if self._users.get((url, name), 0) == 0:
                    urls.discard(url)
                    t = asyncio.create_task(self._unload(url, name))
                    self._tasks.add(t)
                    t.add_done_callback(self._tasks.discard)
            if not urls:
                del self._retired[name]

    async def _unload(self, url: str, name: str) -> None:
        from mrl.sglang.protocol import EngineError, EngineHTTPError

        client = self._clients.get(url)
        if client is None:
            return
        try:
            await client.unload_lora_adapter(name)
            self.unloaded.append((url, name))
        except EngineHTTPError as e:
            if "does not exist" not in str(e):  # a restarted engine never had it: nothing to free
                self.errors.append(f"unloading adapter {name} from {url}: {e}")
        except EngineError as e:  # a dead engine frees its adapters with it
            self.errors.append(f"unloading adapter {name} from {url}: {e}")
