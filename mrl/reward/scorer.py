"""Asynchronous reward scoring: fns loaded by dotted path, run off the event loop, every failure counted.

    scorer = RewardScorer(cfg.reward)
    result = await scorer.score(prompt, response_text)   # RewardResult(value, error); value None = dropped
    results = await scorer.score_many([(prompt, text), ...])
    scorer.stats                                          # {"calls", "errors", "timeouts", "dropped", "pool_restarts"}
    scorer.close()

At most ``reward.num_workers`` calls run at once; ``reward.timeout_s`` starts when a call gets a
worker, so a queue of samples never times out while waiting. A timed-out call cannot be stopped in
a thread (it runs on, its pool is replaced so capacity stays); in a process pool the workers are
terminated and restarted, and other calls that were running there are rerun once. A worker that dies
(a crash in the fn) breaks its pool: the pool is rebuilt and the calls it took down are rerun once.
``reward.executor=auto`` (the default) runs user fns in processes, mrl's built-ins in threads.
More than ``reward.max_error_rate`` of the last calls failing stops the run (``RewardError``).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import logging
import math
import multiprocessing
import numbers
import threading
from collections import deque
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from mrl.config.schema import RewardConfig, RewardExecutor, RewardOnError
from mrl.data.prompt import Prompt

logger = logging.getLogger(__name__)

_NUM_LOGGED_ERRORS = 5  # later errors are counted in stats and returned in RewardResult.error, not logged
ERROR_RATE_WINDOW = 64  # reward.max_error_rate applies to this many most recent calls
BUILTIN_PREFIX = "mrl.reward.builtin."


@functools.cache
def load_reward_fn(path: str) -> Callable[..., Any]:
    """The callable at ``path`` ("pkg.module.fn", or "pkg.module.Class.method"), checked to take 2 args.

    Raises ValueError naming the path and what is wrong: no such module, no such attribute, not
    callable, wrong arity; ImportError when the module exists but fails to import.
    """
    parts = path.split(".")
    if len(parts) < 2 or not all(parts):
        raise ValueError(f"reward.fn={path!r}: expected a dotted path 'package.module.function'")
    obj, missing = None, None
    for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix, then attributes
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
                missing = missing or module_name
                continue
            raise ImportError(f"reward.fn={path!r}: importing module {module_name!r} failed: {e}") from e
        except Exception as e:
            raise ImportError(f"reward.fn={path!r}: importing module {module_name!r} failed: "
                              f"{type(e).__name__}: {e}") from e
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                if missing:
                    raise ValueError(f"reward.fn={path!r}: module {missing!r} not found")
                raise ValueError(f"reward.fn={path!r}: {getattr(obj, '__name__', obj)!r} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        break
    else:
        raise ValueError(f"reward.fn={path!r}: module {missing!r} not found")
    if not callable(obj):
        raise ValueError(f"reward.fn={path!r}: a {type(obj).__name__} is not callable")
    try:
        inspect.signature(obj).bind(None, None)
    except TypeError:
        raise ValueError(f"reward.fn={path!r}: must accept (prompt, response_text), "
                         f"its signature is {inspect.signature(obj)}") from None
    except ValueError:  # no signature available (some builtins): trust it
        pass
    return obj


@dataclass(frozen=True)
class RewardResult:
    """Reward of one response; ``value`` is None when the sample is dropped (``reward.on_error=drop``)."""

    value: float | None
    error: str | None = None

    @property
    def dropped(self) -> bool:
        return self.value is None


class RewardError(RuntimeError):
    """A failed reward call under ``reward.on_error=raise``."""


class _Timeout(Exception):
    pass


def _invoke(fn: Callable[..., Any], prompt: Prompt, response_text: str) -> Any:
    value = fn(prompt, response_text)
    if inspect.isawaitable(value):  # an async fn in a worker: run it on a private loop
        value = asyncio.run(_wait(value))
    return value


async def _wait(awaitable: Any) -> Any:
    return await awaitable


def _init_worker(path: str, pattern_timeout_s: float | None) -> None:
    from mrl.reward import builtin

    builtin.PATTERN_TIMEOUT_S = pattern_timeout_s
    load_reward_fn(path)


def resolve_executor(cfg: RewardConfig) -> RewardExecutor:
    """``auto``: threads for mrl's built-ins (quick, their regexes bounded by ``timeout_s``), processes for
    user fns, whose calls past ``timeout_s`` can only be stopped by ending their process."""
    if cfg.executor is not RewardExecutor.auto:
        return cfg.executor
    return RewardExecutor.thread if cfg.fn.startswith(BUILTIN_PREFIX) else RewardExecutor.process


def _invoke_by_path(path: str, prompt: Prompt, response_text: str) -> Any:
    return _invoke(load_reward_fn(path), prompt, response_text)  # cached: imported once per worker


def _as_reward(value: Any) -> float:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward fn returned a {type(value).__name__}, expected a float")
    if not math.isfinite(value):
        raise ValueError(f"reward fn returned {value}")
    return float(value)


@dataclass
class _Pool:
    executor: Executor
    ready: Future  # done once every worker has started (and imported the reward fn)


class RewardScorer:
    """Scores (prompt, response_text) pairs concurrently off the event loop (see module docstring).

    Use it from one event loop at a time; ``close()`` (or ``with``/``async with``) when done.
    """

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.fn = load_reward_fn(cfg.fn)  # fail fast here, in process mode too
        self.executor = resolve_executor(cfg)
        if self.executor is RewardExecutor.thread:
            from mrl.reward import builtin

            builtin.PATTERN_TIMEOUT_S = cfg.timeout_s  # answer_pattern regexes: the call's limit, in threads too
        # An async fn under the thread executor runs on the event loop itself: it must not block.
        self._on_loop = self.executor is RewardExecutor.thread and inspect.iscoroutinefunction(self.fn)
        self._stats = {"calls": 0, "errors": 0, "timeouts": 0, "dropped": 0, "pool_restarts": 0}
        self._recent: deque[bool] = deque(maxlen=ERROR_RATE_WINDOW)  # failed?, per call
        self._lock = threading.Lock()
        self._pool = self._start_pool()
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    async def score(self, prompt: Prompt, response_text: str) -> RewardResult:
        """The reward of one response; failures follow ``reward.on_error`` and are always counted."""
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        self._stats["calls"] += 1
        try:
            result = RewardResult(_as_reward(await self._run(prompt, response_text)))
            self._recent.append(False)
            return result
        except _Timeout:
            self._stats["timeouts"] += 1
            error = f"timed out after {self.cfg.timeout_s}s"
        except Exception as e:
            self._stats["errors"] += 1
            error = f"{type(e).__name__}: {e}"
        return self._failed(prompt, error)

    async def score_many(self, pairs: Iterable[tuple[Prompt, str]]) -> list[RewardResult]:
        """``score`` for each pair, concurrently; results in input order."""
        return list(await asyncio.gather(*(self.score(p, t) for p, t in pairs)))

    def close(self) -> None:
        """Stop the workers; calls still running in threads finish on their own, processes are terminated."""
        if not self._closed:
            self._closed = True
            _shutdown(self._pool.executor)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> RewardScorer:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    async def _run(self, prompt: Prompt, response_text: str) -> Any:
        async with self._slot():
            for attempt in range(2):
                pool = self._pool
                await asyncio.wrap_future(pool.ready)  # worker start-up is not part of the call's time
                deadline = asyncio.timeout(self.cfg.timeout_s)
                try:
                    async with deadline:
                        if self._on_loop:
                            return await self.fn(prompt, response_text)
                        return await self._submit(pool, prompt, response_text)
                except TimeoutError:
                    if deadline.expired():
                        raise _Timeout from None
                    raise  # a TimeoutError of the fn itself is an ordinary error
                except BrokenProcessPool:
                    # a worker died (a crash in the fn, or another call's timeout ended it): a pool
                    # stays broken for good, so build a new one; the calls it took down run once more
                    self._restart(pool)
                    if attempt == 0:
                        continue
                    raise

    async def _submit(self, pool: _Pool, prompt: Prompt, response_text: str) -> Any:
        if self.executor is RewardExecutor.process:
            fut = pool.executor.submit(_invoke_by_path, self.cfg.fn, prompt, response_text)
        else:
            fut = pool.executor.submit(_invoke, self.fn, prompt, response_text)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            if not fut.cancel():  # already running: its worker is lost to us, replace the pool
                self._restart(pool)
            raise

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem_loop is not loop:
            self._sem, self._sem_loop = asyncio.Semaphore(self.cfg.num_workers), loop
        return self._sem

    def _start_pool(self) -> _Pool:
        ready: Future = Future()
        if self.executor is RewardExecutor.thread:
            ready.set_result(None)
            return _Pool(ThreadPoolExecutor(self.cfg.num_workers, thread_name_prefix="reward"), ready)
        # spawn, not fork: the parent has threads (event loop, torch) that fork would copy mid-state.
        executor = ProcessPoolExecutor(self.cfg.num_workers, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_init_worker, initargs=(self.cfg.fn, self.cfg.timeout_s))
        # Workers start on demand, one per submit that finds none idle: n pings start all n.
        pings = [executor.submit(int) for _ in range(self.cfg.num_workers)]
        threading.Thread(target=_resolve_when_done, args=(pings, ready), daemon=True).start()
        return _Pool(executor, ready)

    def _restart(self, pool: _Pool) -> None:
        with self._lock:
            if self._closed or pool is not self._pool:
                return
            self._pool = self._start_pool()
            self._stats["pool_restarts"] += 1
        _shutdown(pool.executor)

    def _failed(self, prompt: Prompt, error: str) -> RewardResult:
        self._recent.append(True)
        num_failed = self._stats["errors"] + self._stats["timeouts"]
        recent = sum(self._recent)
        if len(self._recent) == ERROR_RATE_WINDOW and recent > self.cfg.max_error_rate * ERROR_RATE_WINDOW:
            raise RewardError(f"reward.fn={self.cfg.fn}: {recent} of the last {ERROR_RATE_WINDOW} calls failed, more "
                              f"than reward.max_error_rate={self.cfg.max_error_rate} ({num_failed} of "
                              f"{self._stats['calls']} in all); last error, on prompt {prompt.id!r}: {error}")
        if num_failed <= _NUM_LOGGED_ERRORS:
            more = " (further failures are only counted)" if num_failed == _NUM_LOGGED_ERRORS else ""
            logger.warning("reward.fn=%s failed on prompt %r: %s%s", self.cfg.fn, prompt.id, error, more)
        if self.cfg.on_error is RewardOnError["raise"]:
            raise RewardError(f"reward.fn={self.cfg.fn} failed on prompt {prompt.id!r}: {error} "
                              "(reward.on_error=raise)")
        if self.cfg.on_error is RewardOnError.drop:
            self._stats["dropped"] += 1
            return RewardResult(None, error)
        return RewardResult(self.cfg.error_value, error)


def _resolve_when_done(futures: list[Future], ready: Future) -> None:
    try:
        for f in futures:
            f.result()
    except BaseException as e:  # e.g. BrokenProcessPool when the fn fails to import in a worker
        ready.set_exception(e)
    else:
        ready.set_result(None)


def _shutdown(executor: Executor) -> None:
    """Shut an executor down without waiting; a process pool's workers are terminated."""
    procs = list((getattr(executor, "_processes", None) or {}).values())  # no public API before 3.14
    executor.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(timeout=5)
