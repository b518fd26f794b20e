"""bench/_engine_profile.py against a real SGLang CPU engine: a profile asked for some time into a
workload covers the asked number of forward steps, the engine writes its trace, and the summary reads it
(on CPU: the operators' time, no kernels)."""

from __future__ import annotations

import asyncio
import os
import sys

from mrl.sglang.client import EngineClient

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from _engine_profile import start_after, summarize_trace, wait_for_trace  # noqa: E402


def test_a_profile_during_a_workload_is_written_and_summed(engines, tmp_path):
    url = engines["tp1"].url
    out = str(tmp_path / "profile")

    async def run():
        client = EngineClient(url)
        try:
            # 400 decode steps: the workload outlasts the 0.2 s delay and the 3 profiled steps by far
            gen = [client.generate([5 + i, 7, 9, 11], {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True},
                                   rid=f"profiled-{i}") for i in range(4)]
            await asyncio.gather(*gen, start_after(url, out, 3, 0.2, cpu=True))
        finally:
            await client.close()

    asyncio.run(run())
    trace = wait_for_trace(out, timeout_s=120)
    assert trace.endswith(".trace.json.gz") and os.path.dirname(trace) == out
    s = summarize_trace(trace, 3)
    assert s["events"] == "cpu_ops" and s["count"] > 0 and s["steps"] == 3
    assert s["total_ms_per_step"] > 0 and abs(sum(s["share"].values()) - 1.0) < 1e-9
