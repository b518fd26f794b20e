"""What every SGLang patch checks before it wraps a method: the method is there, and not wrapped already."""

from __future__ import annotations

import sys
from typing import Any, Callable


def target(module, owner: str, attr: str, flag: str, without: str) -> tuple[Any, Callable] | None:
    """``(module.owner, module.owner.attr)`` to wrap, or None: the method is missing (one line on stderr, the
    engine log: ``without`` says what the engine does then) or already carries ``flag`` (patched before)."""
    cls = getattr(module, owner, None)
    fn = getattr(cls, attr, None)
    if fn is None:
        print(f"mrl: {module.__name__} has no {owner}.{attr}: {without}", file=sys.stderr, flush=True)
        return None
    if getattr(fn, flag, False):
        return None
    return cls, fn
