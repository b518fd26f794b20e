"""What SGLang engines write in their logs, read back for benchmarks: the lines that mark an engine's start
phases, what mrl's patches say about each weight bucket's load, and the scheduler's statistics.

SGLang logs a "Decode batch" line every ``decode_log_interval`` decode steps with the tokens generated
since its last such line over the time since then, and a "Prefill batch" line for every prefill. So a
decode line's figure is decode alone only when the line before it was a decode line too: otherwise its
interval holds prefills, or the idle time before a run."""

from __future__ import annotations

import os
import re
import statistics

_KIND = re.compile(r"\b(Prefill|Decode) batch\b[^,]*,(.*)$")
_FIELD = re.compile(r"\s*([^:,]+):\s*([^,]+)")
_NAMES = {"#running-req": "running", "#queue-req": "queue", "#new-seq": "new_seq", "#new-token": "new_tokens",
          "gen throughput (token/s)": "gen_tokens_per_s", "input throughput (token/s)": "input_tokens_per_s"}


def log_size(path: str | None) -> int:
    """Where the log ends now (0 when there is none yet): the offset a run's lines start after."""
    return os.path.getsize(path) if path and os.path.exists(path) else 0


def stats_lines(path: str | None, start: int = 0) -> list[dict]:
    """The scheduler's prefill and decode lines of the log from byte ``start`` on, in order: {"kind":
    "prefill"|"decode", and the numeric fields SGLang prints (running, queue, gen_tokens_per_s, ...)}."""
    if not path or not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    out = []
    for line in text.splitlines():
        m = _KIND.search(line)
        if not m:
            continue
        row: dict = {"kind": m.group(1).lower()}
        for key, value in _FIELD.findall(m.group(2)):
            name = _NAMES.get(key.strip())
            if name:
                try:
                    row[name] = float(value)
                except ValueError:
                    continue
        out.append(row)
    return out


def full_batch_decode(lines: list[dict], batch: int, share: float = 0.9) -> dict:
    """The decode tokens/s SGLang reported while at least ``share`` of ``batch`` requests ran and none
    waited, counting only lines whose interval held no prefill (the line before them was a decode line):
    {"tokens_per_s": their median, or None without such a line, "lines": how many}."""
    kept = [cur["gen_tokens_per_s"] for prev, cur in zip(lines, lines[1:])
            if prev["kind"] == cur["kind"] == "decode" and "gen_tokens_per_s" in cur
            and cur.get("running", 0) >= share * batch and cur.get("queue", 1) == 0]
    return {"tokens_per_s": statistics.median(kept) if kept else None, "lines": len(kept)}


ENGINE_MARKS = ("Init torch distributed", "Load weight", "KV Cache is allocated", "Memory pool end", "Capture",
                "piecewise", "Compil", "max_total_num_tokens", "Uvicorn running", "fired up")


def engine_timeline(log_dir: str) -> dict[str, list[str]]:
    """The lines of each engine's log that mark its start phases (SGLang stamps them with the time)."""
    out = {}
    if os.path.isdir(log_dir):
        for name in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                out[name] = [line.rstrip()[:300] for line in f if any(m in line for m in ENGINE_MARKS)]
    return out


def engine_load_lines(log_dir: str) -> dict:
    """What the engine logs say about its bucket loads (``mrl.engine.server.patches``): layouts replayed
    as copies, layouts left to ``load_weights`` and why (a refused layout costs the model's per-tensor
    load on every sync)."""
    from mrl.sglang.wire import REPLAYED_LOAD_MARK

    out = {"replayed_as_copies": 0, "load_weights": 0, "load_weights_reasons": []}
    for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
        with open(os.path.join(log_dir, name), errors="replace") as f:
            for line in f:
                if REPLAYED_LOAD_MARK in line:
                    out["replayed_as_copies"] += 1
                elif "mrl: bucket layout loads through load_weights" in line:
                    out["load_weights"] += 1
                    why = line.split(":", 2)[-1].strip()[:300]
                    if why not in out["load_weights_reasons"] and len(out["load_weights_reasons"]) < 10:
                        out["load_weights_reasons"].append(why)
    return out
