"""What a rank of a fault test did: the error its call raised (type, message) and how long it took, written
to ``<out>/rank<r>.json``; the process then exits at once (its process group is broken: no teardown)."""

import json
import os
import time


def record_outcome(out: str, rank: int, call) -> None:
    t0 = time.monotonic()
    try:
        call()
        res = {"type": None, "message": "no error"}
    except Exception as e:
        res = {"type": type(e).__name__, "message": str(e)}
    res["seconds"] = time.monotonic() - t0
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)
