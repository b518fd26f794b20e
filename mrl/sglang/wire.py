"""What mrl's engines and the processes that talk to them agree on beyond SGLang's own protocol: the formats
and marks of the weight-update extensions the engine patches add (``mrl.engine.server.patches``), the log
lines that say a patch is in place, and the names LoRA adapters carry on an engine.

An extension is used only when the engine announced it (its mark in an answer); an engine without the
patches gets SGLang's own requests. Constants and pure functions only: the engine server imports this
module too, and nothing else of mrl's client side.
"""

from __future__ import annotations

import re

REPLAYED_LOAD_MARK = "mrl: bucket layout replayed as copies"
"""Printed to the engine's log with the plan's size when a bucket layout's load was recorded."""
COMPACT_ROUTES_MARK = "mrl: routes leave the scheduler in the smallest integer type (mrl.engine.server.patches)"
"""Printed to the engine's log when the patch is in place (once per server process that loads the module)."""
BATCHED_BUCKETS_FORMAT = "mrl_buckets:"
"""``load_format`` prefix of one ``/update_weights_from_distributed`` request that carries every bucket of a
sync, in the senders' global order: the prefix is followed by the JSON list ``[[group name, tensor count],
...]`` (one entry per bucket) and ``names``/``dtypes``/``shapes`` are the buckets' lists back to back. Only
engines whose ``/init_weights_update_group`` answer carries ``BATCHED_BUCKETS_MARK`` (this patch) read it;
others get one request per bucket."""
BATCHED_BUCKETS_MARK = "[mrl: batched buckets]"
KEEPS_LAYOUTS_MARK = "[mrl: kept layouts]"
"""In the ``/init_weights_update_group`` answer: the engine keeps a batched request's tensor lists by key.
A trainer then sends ``{"key": K, "layout": [...]}`` after the prefix with the lists once; the answer carries
``LAYOUT_KEPT_MARK`` + K + ``]``, and later syncs send ``{"key": K}`` with empty lists: a few hundred bytes
instead of every tensor's name, dtype and shape through SGLang's HTTP server, tokenizer manager and
scheduler before the first receive is posted."""
LAYOUT_KEPT_MARK = "[mrl: layout kept "
FLAT_TENSOR_FORMAT = "mrl_flat:"
"""``load_format`` prefix of an ``/update_weights_from_tensor`` request (CUDA IPC) whose one tensor is a
whole bucket's flat uint8 buffer, laid out as a ``flattened_bucket`` broadcast; the prefix is followed by
the JSON ``{"key", "names", "dtypes", "shapes"}``. The engine loads it as a broadcast bucket (replayed
copies from the second sync of a layout on) and answers once its copies are done, so the sender may
refill the buffer. Only engines whose answers to ``/update_weights_from_tensor`` carry ``FLAT_TENSOR_MARK``
(this patch) get it: SGLang itself fails on an unknown ``load_format``."""
FLAT_TENSOR_MARK = "[mrl: flat tensor buckets]"
STAGED_FORMAT = "mrl_staged:"
"""``load_format`` prefix of a disk, tensor or distributed update that the engine loads while it keeps generating
and swaps in at the next ``/continue_generation`` (``mrl.engine.server.staged``); the engine's own
``load_format`` follows it (nothing: the default). Only engines mrl starts understand it."""
STAGED_MARK = "mrl: staged weight update"
"""Begins the engine's log line of each staged load (its seconds and the forward passes the engine ran meanwhile);
its answer carries the count as ``[mrl: staged, N forward passes during the load]``."""
TOKEN_VERSIONS_KEY = "mrl_token_versions"
"""``meta_info`` key of a ``/generate`` reply from an engine with the in-flight patch
(``mrl.engine.server.inflight``): per output token, the weight version whose forward pass produced it (an int
where the version is one). Engines without the patch leave it out."""
TOKEN_VERSIONS_MARK = "mrl: each output token carries the weight version that produced it (mrl.engine.server.inflight)"
"""Printed to the engine's log when the in-flight patch is in place (once per server process that loads it)."""


# -- LoRA adapters on an engine -----------------------------------------------------------------------
NAME_PREFIX = "policy"
_NAME = re.compile(rf"^{NAME_PREFIX}@v(\d+)$")


def adapter_name(version: int) -> str:
    """The engine-side name of policy version ``version`` (one adapter per version: no in-place update)."""
    if version < 0:
        raise ValueError(f"adapter version must be >= 0, got {version}")
    return f"{NAME_PREFIX}@v{version}"


def adapter_version(name: str) -> int:
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not an mrl adapter name ({NAME_PREFIX}@v<n>)")
    return int(m.group(1))
