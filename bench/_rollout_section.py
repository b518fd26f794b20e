"""The rollout section of bench/gpu_loop.py: GRPO-shaped workloads through mrl's RolloutManager against
live engines, the kinds (routes off/on, a plain engine, compared engines) alternating per repetition,
per-repetition ratios between kinds, and what the engines themselves report (decode alone from their logs,
py-spy of their processes, SGLang's profiler)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import subprocess
import time

from _engine_log import full_batch_decode, log_size, stats_lines

async def workload(url: str, codec, batch: int, prompt_len: int, new: int, vocab: int, seed: int,
                   timing: dict | None = None, samples: int | None = None, spread: float = 0.0):
    """``batch`` samples in flight; ``samples`` in all (default ``batch``; more: a stream, each finished
    sample's slot taken by the next at once); each sample's new tokens uniform in ``new`` x [1 - spread,
    1 + spread] (seeded: the same for every kind of a repetition). ``timing``: filled with where the run's
    wall time went per request (``request_timing``)."""
    from mrl.rollout.manager import RolloutManager
    from mrl.rollout.sample import SamplingSpec

    rng = random.Random(seed)
    client = _timed_client(url)
    codec = _TimedCodec(codec) if codec is not None else None
    mgr = RolloutManager([client], codec=codec, max_inflight_per_engine=batch,
                         sampling=SamplingSpec(max_new_tokens=new, temperature=1.0, ignore_eos=True))
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range((samples or batch) // 8)]
    lo, hi = max(1, round(new * (1 - spread))), round(new * (1 + spread))
    budgets = [[rng.randint(lo, hi) for _ in range(8)] if spread else None for _ in prompts]
    t = time.perf_counter()
    groups = await asyncio.gather(*(mgr.generate_group(p, n=8, group_id=i, max_new_tokens=b)
                                    for i, (p, b) in enumerate(zip(prompts, budgets))))
    dt = time.perf_counter() - t
    await client.close()
    if timing is not None:
        timing |= request_timing(client.calls, t, t + dt)
    samples = [s for g in groups for s in g]
    if mgr.stats.failed:
        raise RuntimeError(f"{mgr.stats.failed} samples failed: {mgr.stats.errors[:3]}")
    return samples, sum(len(s.response_ids) for s in samples) / dt, dt, codec.seconds if codec else 0.0


def _timed_client(url: str):
    """mrl's engine client, recording for each /generate when it was posted and answered (perf_counter)
    and SGLang's own ``e2e_latency`` for it (from the request's arrival at its tokenizer manager to the
    last token)."""
    from mrl.sglang.client import EngineClient

    class TimedClient(EngineClient):
        def __init__(self, url):
            super().__init__(url)
            self.calls: list[tuple[float, float, float | None]] = []

        async def _call(self, method, endpoint, **kw):
            t0 = time.perf_counter()
            status, body, text = await super()._call(method, endpoint, **kw)
            if endpoint == "/generate" and isinstance(body, dict):
                e2e = (body.get("meta_info") or {}).get("e2e_latency")
                self.calls.append((t0, time.perf_counter(), float(e2e) if e2e is not None else None))
            return status, body, text

    return TimedClient(url)


def request_timing(calls: list[tuple[float, float, float | None]], start: float, end: float) -> dict:
    """Where a run's wall time went, from each request's (posted, answered, SGLang's e2e_latency), all
    seconds from the run's ``start``: when the client had posted the last request, the first and last
    answers, what followed the last answer until the run ended (the client's own work), the engine's
    time per request, the time outside it (HTTP both ways, the server's parsing and serializing), and the
    spread of the requests' arrivals at the engine (answer minus e2e: all in at once gives 0)."""
    if not calls:
        return {}
    sends, answers = [c[0] - start for c in calls], [c[1] - start for c in calls]
    out = {"requests": len(calls), "last_post_s": max(sends), "first_answer_s": min(answers),
           "last_answer_s": max(answers), "after_last_answer_s": end - start - max(answers)}
    timed = [c for c in calls if c[2] is not None]
    if timed:
        e2e = [c[2] for c in timed]
        arrivals = [c[1] - start - c[2] for c in timed]  # the engine's start of each, less the answer's way back
        out |= {"engine_e2e_median_s": statistics.median(e2e), "engine_e2e_max_s": max(e2e),
                "outside_engine_median_s": statistics.median(c[1] - c[0] - c[2] for c in timed),
                "outside_engine_max_s": max(c[1] - c[0] - c[2] for c in timed),
                "engine_arrival_spread_s": max(arrivals) - min(arrivals), "engine_first_arrival_s": min(arrivals)}
    return out


class _TimedCodec:
    """The routes codec, with the client's seconds spent decoding routes counted (they sit in the
    workload's wall time: the client's event loop decodes each reply as it arrives)."""

    def __init__(self, codec):
        self._codec, self.seconds = codec, 0.0

    def __getattr__(self, name):
        return getattr(self._codec, name)

    def decode(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._codec.decode(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


async def routes_payload(url: str, codec, prompt_len: int, new: int, vocab: int) -> dict:
    """Bytes of one reply's routes as the engine sends them (base64), per token, and per expert id."""
    import base64

    from mrl.sglang.client import EngineClient

    c = EngineClient(url)
    ids = [3 + i % (vocab - 3) for i in range(prompt_len)]
    out = await c.generate(ids, {"max_new_tokens": new, "ignore_eos": True}, rid=f"payload-{time.time_ns()}",
                           return_routed_experts=True)
    await c.close()
    rows = prompt_len + len(out.output_ids) - 1
    raw = len(base64.b64decode(out.routed_experts))
    return {"routes_b64_bytes": len(out.routed_experts), "rows": rows,
            "bytes_per_token": len(out.routed_experts) / rows, "raw_bytes_per_token": raw / rows,
            "bytes_per_expert_id": codec.wire_itemsize(raw, rows)}


def _py_spy(a, engine_pid: int, out: str) -> subprocess.Popen | None:
    """Sample the engine's processes (server, scheduler, detokenizer) while one workload runs."""
    if not a.py_spy:
        return None
    return subprocess.Popen([a.py_spy_bin, "record", "--pid", str(engine_pid), "--subprocesses", "--nonblocking",
                             "--rate", "200", "--duration", str(a.py_spy), "--format", "raw", "--output", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def spy_summary(raw_path: str, top: int = 25) -> dict:
    """py-spy's collapsed stacks (``process;frame;...;leaf count``) -> per process: samples, the leaf
    frames with most samples (self time) and the frames with most samples anywhere on the stack."""
    procs: dict[str, dict] = {}
    for line in open(raw_path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        k = 0  # a child process's stack sits under its parents' "process PID:cmdline" frames
        while k + 1 < len(frames) and frames[k + 1].startswith("process "):
            k += 1
        name, frames = frames[k][:90], frames[k + 1:] or ["(no frame)"]
        p = procs.setdefault(name, {"samples": 0, "self": {}, "total": {}})
        p["samples"] += int(n)
        p["self"][frames[-1]] = p["self"].get(frames[-1], 0) + int(n)
        for f in set(frames):
            p["total"][f] = p["total"].get(f, 0) + int(n)
    return {name: {"samples": p["samples"],
                   "self_top": sorted(p["self"].items(), key=lambda kv: -kv[1])[:top],
                   "total_top": sorted(p["total"].items(), key=lambda kv: -kv[1])[:top],
                   # SGLang's overlapped scheduler blocks here on the GPU's copy-done event of the step it
                   # launched before: a large share means the GPU sets the pace, near zero its host loop does
                   "waits_on_gpu": sum(v for f, v in p["self"].items() if f.startswith("Event.synchronize"))
                   / max(p["samples"], 1)}
            for name, p in sorted(procs.items(), key=lambda kv: -kv[1]["samples"])}


def scheduler_gpu_wait(summary: dict) -> float | None:
    """The scheduler's share of samples spent waiting for the GPU (see ``spy_summary``)."""
    return next((v["waits_on_gpu"] for k, v in summary.items() if "scheduler" in k), None)


# the kinds of rollout run: (engine, routes requested). "on"/"off": the routes engine with and without
# routes in the requests; "plain": the engine started without route capture (--plain-engine-gpu); any other
# engine (--fp8-engine-gpu, --variant) is its own kind, routes requested, compared with "on"
KINDS = {"off": ("routes", False), "on": ("routes", True), "plain": ("plain", False)}


def _kind(name: str) -> tuple[str, bool]:
    return KINDS.get(name, (name, True))


def _ratios(runs: list[dict], batch: int, num: str, den: str, key: str = "tokens_per_s") -> dict:
    """Per-repetition throughput ratios kind ``num`` / kind ``den`` at ``batch``: median, min, max (empty
    where no repetition has ``key`` on both sides)."""
    by = {k: {r["rep"]: r.get(key) for r in runs if r["batch"] == batch and r["kind"] == k} for k in (num, den)}
    per_rep = [by[num][rep] / by[den][rep] for rep in sorted(by[num]) if by[num][rep] and by[den].get(rep)]
    if not per_rep:
        return {}
    return {"median": statistics.median(per_rep), "min": min(per_rep), "max": max(per_rep), "per_rep": per_rep}


def rollout_section(urls: dict[str, str], codec, vocab, a, pids: dict[str, int] | None = None,
                    logs: dict[str, str] | None = None) -> dict:
    """``urls``: {"routes": the engine with route capture, "plain": one without (optional), others: engines
    compared with the routes engine, routes on (FP8 weights, other server args)}; ``pids``: their server
    processes, for ``--py-spy`` (each kind sampled during its first run of the largest batch); ``logs``:
    their log files, from which each run also gets the decode tokens/s SGLang reported while the batch was
    full (``engine_decode_tokens_per_s``: decode alone, without the prefills in ``tokens_per_s``)."""
    extra = [k for k in urls if k not in ("routes", "plain")]
    skip = ("off",) if getattr(a, "skip_off", False) else ()
    kinds = [k for k in ("off", "on", "plain") if KINDS[k][0] in urls and k not in skip] + extra
    samples, spread = getattr(a, "samples", None), getattr(a, "new_spread", 0.0)
    res = {"batches": a.batches, "prompt_len": a.prompt_len, "new": a.new, "reps": a.reps, "kinds": kinds,
           "samples": samples, "new_spread": spread, "pairs": list(getattr(a, "pair", [])), "runs": [],
           "dropped": {}}

    def drop(kind: str, e: Exception) -> None:
        """An engine compared with the routes one (an FP8 kernel variant) that fails a request loses its
        kind, not the section: the other kinds' figures stand, the error goes in the report."""
        if kind in ("routes", "off", "on", "plain"):  # the baselines of every ratio
            raise e
        res["dropped"][kind] = f"{type(e).__name__}: {e}"[:1500]
        kinds.remove(kind)
        print(f"[rollout] {kind} dropped: {res['dropped'][kind][:300]}", flush=True)

    for name, url in urls.items():  # warm-up (first requests, graphs)
        try:
            asyncio.run(workload(url, codec if name != "plain" else None, 8, a.prompt_len, 16, vocab, seed=0))
        except Exception as e:
            drop(name, e)
    for rep in range(a.reps):
        for batch in a.batches:
            # the order turns with each repetition: no kind always runs first after a batch size change
            for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
                engine, routes = _kind(kind)
                spy = None
                if rep == 0 and batch == max(a.batches) and (pids or {}).get(engine):
                    spy_out = os.path.join(a.out, f"py_spy_batch{batch}_{engine}_{kind}.txt")
                    spy = _py_spy(a, pids[engine], spy_out)
                log = (logs or {}).get(engine)
                start = log_size(log)
                timing: dict = {}
                try:
                    _, tps, dt, dec = asyncio.run(workload(urls[engine], codec if routes else None, batch,
                                                            a.prompt_len, a.new, vocab, seed=rep, timing=timing,
                                                            samples=samples, spread=spread))
                except Exception as e:
                    drop(kind, e)
                    continue
                full = full_batch_decode(stats_lines(log, start), batch)
                res["runs"].append({"rep": rep, "batch": batch, "kind": kind, "engine": engine, "routes": routes,
                                    "tokens_per_s": tps, "seconds": dt, "client_decode_s": dec,
                                    "engine_decode_tokens_per_s": full["tokens_per_s"],
                                    "engine_decode_lines": full["lines"], "requests": timing})
                print(f"[rollout] rep {rep} batch {batch} {kind}: {tps:.0f} tokens/s", flush=True)
                if spy is not None:
                    _, err = spy.communicate(timeout=a.py_spy + 60)
                    key = f"py_spy_batch{batch}_{engine}_{kind}"
                    res[key] = (spy_summary(spy_out) if spy.returncode == 0 and os.path.exists(spy_out)
                                else {"error": f"py-spy exited {spy.returncode}: {err[-1500:]}"})
                    if "error" not in res[key]:
                        res.setdefault("scheduler_waits_on_gpu", {})[f"batch{batch}_{kind}"] = \
                            scheduler_gpu_wait(res[key])
    if a.engine_profile:
        res["engine_profile"] = engine_profiles(urls, kinds, codec, vocab, a)
    # a dropped kind's earlier runs stay in the report, out of the ratios (their repetitions are incomplete)
    res["dropped_runs"] = [r for r in res["runs"] if r["kind"] not in kinds]
    res["runs"] = [r for r in res["runs"] if r["kind"] in kinds]
    extra = [k for k in extra if k in kinds]
    summary = {}
    for batch in a.batches:
        med = {k: statistics.median(r["tokens_per_s"] for r in res["runs"] if r["batch"] == batch and r["kind"] == k)
               for k in kinds}
        s = {"routes_on_median": med["on"]}
        if "off" in kinds:
            r = _ratios(res["runs"], batch, "on", "off")
            s |= {"routes_off_median": med["off"], "on_vs_off_median": r["median"], "on_vs_off_min": r["min"],
                  "on_vs_off_max": r["max"]}
        if "plain" in kinds:  # the fair baseline: an engine that does not capture routes at all
            r = _ratios(res["runs"], batch, "on", "plain")
            s |= {"plain_median": med["plain"], "routes_on_vs_plain_median": r["median"],
                  "routes_on_vs_plain_min": r["min"], "routes_on_vs_plain_max": r["max"],
                  "routes_off_vs_plain_median": _ratios(res["runs"], batch, "off", "plain")["median"]}
        pairs = [(k, "on") for k in extra] + [tuple(p.split(":", 1)) for p in res["pairs"]]
        for num, den in pairs:  # the same workload, routes on, on another engine (or between two such)
            if num in res["dropped"] or den in res["dropped"]:
                continue  # a dropped kind: no ratio
            r, tag = _ratios(res["runs"], batch, num, den), f"{num}_vs_{den}"
            if den == "on":
                s[f"{num}_median"] = med[num]
            s |= {f"{tag}_median": r["median"], f"{tag}_min": r["min"], f"{tag}_max": r["max"],
                  f"{tag}_per_rep": r["per_rep"]}
            d = _ratios(res["runs"], batch, num, den, "engine_decode_tokens_per_s")
            if d:  # decode alone, as the engines logged it while the batch was full
                tag = f"{num}_decode_vs_{den}"
                s |= {f"{tag}_median": d["median"], f"{tag}_min": d["min"], f"{tag}_max": d["max"],
                      f"{tag}_per_rep": d["per_rep"]}
        s["request_timing_median"] = timing_medians(res["runs"], batch, kinds)
        summary[f"batch{batch}"] = s
    res["payload"] = asyncio.run(routes_payload(urls["routes"], codec, a.prompt_len, a.new, vocab))
    for s in summary.values():  # the same engine, so the same payload at every batch size
        s["routes_b64_bytes_per_token"] = res["payload"]["bytes_per_token"]
        s["routes_bytes_per_expert_id"] = res["payload"]["bytes_per_expert_id"]
    res["summary"] = summary
    print(f"[rollout] routes payload: {res['payload']['bytes_per_token']:.0f} base64 bytes per token, "
          f"{res['payload']['bytes_per_expert_id']} byte(s) per expert id", flush=True)
    return res


def timing_medians(runs: list[dict], batch: int, kinds: list[str]) -> dict:
    """Per kind, the median over its repetitions of each ``request_timing`` figure, with a run's seconds
    outside full-batch decode (its wall time less the decode the engine logged at its full-batch rate)."""
    out = {}
    for kind in kinds:
        rs = [r for r in runs if r["batch"] == batch and r["kind"] == kind]
        keys = sorted({k for r in rs for k in r.get("requests") or {}} - {"requests"})
        m = {k: statistics.median(r["requests"][k] for r in rs if k in (r.get("requests") or {})) for k in keys}
        outside = [r["seconds"] - r["tokens_per_s"] * r["seconds"] / r["engine_decode_tokens_per_s"]
                   for r in rs if r.get("engine_decode_tokens_per_s")]
        if outside:
            m["outside_full_batch_decode_s"] = statistics.median(outside)
        out[kind] = m
    return out


def engine_profiles(urls: dict[str, str], kinds: list[str], codec, vocab: int, a) -> dict:
    """One more run of the largest batch per kind (routes requested; not among the timed repetitions: the
    profiler slows it), SGLang's profiler on ``--engine-profile`` forward steps from ``--engine-profile-delay``
    seconds in (decode steps, after the prefills); each trace summed by kernel category
    (``_engine_profile``)."""
    from _engine_profile import start_after, summarize_trace, wait_for_trace

    out: dict = {}
    for kind in (k for k in kinds if k != "off"):
        engine, routes = _kind(kind)
        where = os.path.join(os.path.abspath(a.out), "engine_profile", kind)
        os.makedirs(where, exist_ok=True)

        async def profiled():
            return (await asyncio.gather(
                workload(urls[engine], codec if routes else None, max(a.batches), a.prompt_len, a.new, vocab,
                          seed=10_000),
                start_after(urls[engine], where, a.engine_profile, a.engine_profile_delay, a.cpu)))[0]

        try:
            asyncio.run(profiled())
            out[kind] = summarize_trace(wait_for_trace(where), a.engine_profile) | {"trace": where}
        except Exception as e:  # a profile is extra evidence: its failure costs no figure
            out[kind] = {"error": f"{type(e).__name__}: {e}"[:1500]}
        print(f"[rollout] engine profile {kind}: {json.dumps(out[kind])[:400]}", flush=True)
    return out


# -- Keep Routing ----------------------------------------------------------------------------------
