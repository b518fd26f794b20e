"""Loaded only by SGLang server processes mrl starts on GPUs (PYTHONPATH set by the launcher).

Installs the patches every mrl engine gets (``mrl.engine.server.patches``), none of CPU mode's (those
live in ``mrl/engine/server/cpu/pyshim``). An engine that cannot import them starts unpatched: routes then
stay int32, which mrl's decoder reads too. A ``sitecustomize`` this one shadows (a site's own, further
down the path) still runs afterwards.
"""
import importlib.machinery
import importlib.util
import os
import sys

try:
    from mrl.engine.server.patches import install

    install()
except Exception as e:  # a server without the patches beats a server that does not start
    print(f"mrl: engine patches not installed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_shadowed()
