"""Keep Routing end to end: experts recorded by a real SGLang engine, replayed in Megatron training.

The engine serves the tiny model; the trainer holds the same weights one update ahead (a small
perturbation of every tensor: the engine is one weight version behind, as with stale rollouts), so
natural training routing differs from the sampled one. Under TP2+SP, EP2 (DP2), TP2xEP2, PP2 (uneven)
with activation recompute and PP2 without, 2 micro-batches each, unpacked (one sample per row) and
packed (first-fit rows of 32 tokens, block-diagonal causal mask) in the same run:
- every router dispatches exactly the engine's experts, token for token (forward and recompute);
- logprobs equal those of the single-process replay run, and packed equal unpacked;
- replay off (natural routing) disagrees with the engine; replay on does not (KL of the training
  logprobs vs the engine's reported for both);
- the routes these checks replay reached mrl as uint8, a quarter of SGLang's int32
  (``mrl.engine.server.patches``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mrl.models import get_bridge
from mrl.sglang.client import EngineClient
from mrl.sglang.wire import COMPACT_ROUTES_MARK
from mrl.rollout.manager import RolloutManager
from mrl.rollout.sample import SamplingSpec
from mrl.routing.codec import RoutesCodec
from tests.conftest import run_torchrun

PROMPTS = [[1, 17, 42, 99, 7], [1, 300, 5], [1, 11, 12, 13, 14, 15, 16], [1, 250, 251],
           [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 400], [1, 77, 78, 79], [1, 2, 3, 4, 5, 6]]
PACK_LEN = 32  # 10 new tokens each: rows hold 1-2 samples, some a tail, some micro-batches an empty row
LAYOUTS = {  # name: layout (tests.jobs.parity), all in one 2-process launch
    "tp2": "tp=2,recompute=1",
    "ep2": "ep=2,recompute=1",
    "tp2ep2": "tp=2,ep=2,etp=1,recompute=1",
    "pp2": "pp=2,pp_first=2,recompute=1",
    "pp2_norecompute": "pp=2,pp_first=2",
}


WIRE: list[tuple[int, int]] = []


class _WireRecordingCodec(RoutesCodec):
    """The manager's codec, noting (payload bytes, rows) of every routes reply it decodes in ``WIRE``."""

    def decode(self, b64, *, prompt_len, response_len):
        WIRE.append((len(base64.b64decode(b64)), self.expected_rows(prompt_len, response_len)))
        return super().decode(b64, prompt_len=prompt_len, response_len=response_len)


@pytest.fixture(scope="module")
def samples(engines, ckpt_dir, tmp_path_factory):
    codec = _WireRecordingCodec(**vars(RoutesCodec.from_bridge(get_bridge(ckpt_dir["tiny"]))))

    async def go():
        mgr = RolloutManager([EngineClient(engines["tp1"].url)], codec=codec,
                             sampling=SamplingSpec(max_new_tokens=10, temperature=1.0, ignore_eos=True))
        groups = await asyncio.gather(*(mgr.generate_group(p, n=1, group_id=i) for i, p in enumerate(PROMPTS)))
        return [g[0] for g in groups]

    out = asyncio.run(go())
    path = tmp_path_factory.mktemp("replay") / "samples.json"
    path.write_text(json.dumps({"sequences": [s.tokens for s in out], "routes": [s.routes.tolist() for s in out],
                                "engine_logprobs": [s.response_logprobs for s in out],
                                "prompt_lens": [len(s.prompt_ids) for s in out],
                                "routes_wire": [list(w) for w in WIRE], "ids_per_row": codec.num_layers * codec.top_k}))
    return path


def test_routes_reach_mrl_as_uint8(samples, engines):
    """One byte per expert id (a quarter of SGLang's int32): the replay checks below compare the trainer's
    routers with exactly these routes."""
    sj = json.loads(samples.read_text())
    assert len(sj["routes_wire"]) == len(PROMPTS)
    assert all(nbytes == rows * sj["ids_per_row"] for nbytes, rows in sj["routes_wire"]), sj["routes_wire"]
    with open(engines["tp1"].log_path) as f:
        assert COMPACT_ROUTES_MARK in f.read()


@pytest.fixture(scope="module")
def ahead(ckpt_dir, tmp_path_factory):
    """The engine's checkpoint one update ahead: every tensor moved by 3% of its scale."""
    src = ckpt_dir["tiny"]
    dst = tmp_path_factory.mktemp("ahead")
    g = torch.Generator().manual_seed(0)
    sd = load_file(os.path.join(src, "model.safetensors"))
    sd = {k: v + 0.03 * v.std() * torch.randn(v.shape, generator=g) if v.numel() > 1 else v for k, v in sd.items()}
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for fn in os.listdir(src):
        if fn.endswith(".json"):
            (dst / fn).write_bytes(open(os.path.join(src, fn), "rb").read())
    return str(dst)


def _run(ahead, samples, out, nproc, args, layouts: dict[str, str] | None = None):
    """The replay job; its rank reports (or, with ``layouts``, {name: rank reports}, every layout in turn
    within one launch)."""
    if layouts:
        args = [*args, "--layouts", *(f"{k}:{v}" for k, v in layouts.items())]
    r = run_torchrun("tests.jobs.replay_check", ["--hf", ahead, "--input", str(samples), "--out", str(out),
                                               "--micro-batches", "2", "--pack-len", str(PACK_LEN), *args],
                     nproc, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]

    def reports(d):
        return [json.loads((d / f).read_text()) for f in sorted(os.listdir(d))]

    return {name: reports(out / name) for name in layouts} if layouts else reports(out)


@pytest.fixture(scope="module")
def reference(ahead, samples, tmp_path_factory):
    return _run(ahead, samples, tmp_path_factory.mktemp("ref"), 1, [])[0]


def _sample_at(samples_json, rep, mb, b, s, packed):
    """(sample, position in it) of row b, position s of micro-batch mb; (None, None) on padding."""
    if not packed:
        return rep["sequences"][mb * rep["per_mb"] + b], s
    for i, row, off in rep["packed_rows"][mb]:
        if row == b and off <= s < off + len(samples_json["sequences"][i]):
            return i, s - off
    return None, None


def _expected(samples_json, rep, mb, col, packed=False):
    """Engine experts for this rank's routers, micro-batch ``mb``, local MoE layer ``col``: token i of
    the router input is (s, b) = (s0 + i // rows, i % rows), s-first, with SP chunking over TP."""
    seq_len, rows = (rep["packed_row_len"], rep["packed_num_rows"]) if packed else (rep["seq_len"], rep["per_mb"])
    chunk = seq_len // rep["tp"] if rep["sp"] else seq_len
    s0 = rep["tp_rank"] * chunk if rep["sp"] else 0
    out = []
    for s in range(s0, s0 + chunk):
        for b in range(rows):
            seq, t = _sample_at(samples_json, rep, mb, b, s, packed)
            routes = samples_json["routes"][seq] if seq is not None else []
            # engine rows: every position but the last; the rest is padding
            out.append(sorted(routes[t][rep["moe_columns"][col]]) if seq is not None and t < len(routes) else None)
    return out


def _check_routers(samples_json, rep, calls, packed=False):
    ncol = len(rep["moe_columns"])
    assert len(calls) == 2 * ncol, f"rank {rep['rank']}: {len(calls)} router calls"
    checked = 0
    for n, (col, ids) in enumerate(calls):
        # one call per local MoE layer per micro-batch (recompute runs the layers in reverse order)
        assert sorted(c for c, _ in calls[n - n % ncol:n - n % ncol + ncol]) == list(range(ncol))
        for got, want in zip(ids, _expected(samples_json, rep, n // ncol, col, packed), strict=True):
            if want is not None:
                assert got == want
                checked += 1
    return checked


def _logprobs_by_seq(reps, key):
    out = {}
    for rep in reps:
        if rep[key] and rep["tp_rank"] == 0:
            for mb, lps in enumerate(rep[key]):
                for b, lp in enumerate(lps):
                    out[rep["sequences"][mb * rep["per_mb"] + b]] = np.asarray(lp)
    return out


@pytest.fixture(scope="module")
def replayed(ahead, samples, tmp_path_factory):
    return _run(ahead, samples, tmp_path_factory.mktemp("layouts"), 2, [], LAYOUTS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replay_equals_engine_records_and_single_process(name, samples, reference, replayed):
    reps = replayed[name]
    sj = json.loads(samples.read_text())
    for packed, prefix in ((False, ""), (True, "packed_")):
        checked = sum(_check_routers(sj, rep, rep[prefix + "forward_calls"], packed) for rep in reps)
        # every (engine-routed token, MoE layer) exactly once over the ranks
        assert checked == sum(len(x) - 1 for x in sj["sequences"]) * len(reference["moe_columns"]), (packed, checked)
        if "recompute" in LAYOUTS[name]:  # the recompute pass replays the same experts (REPLAY_BACKWARD queue)
            assert all(_check_routers(sj, rep, rep[prefix + "recompute_calls"], packed) for rep in reps)
        else:
            assert all(rep[prefix + "recompute_calls"] == [] for rep in reps)
    ref = _logprobs_by_seq([reference], "logprobs_replay")
    for key in ("logprobs_replay", "logprobs_packed"):
        got = _logprobs_by_seq(reps, key)
        ref_same = _logprobs_by_seq([reference], key)  # single process, same packing or none
        assert sorted(got) == sorted(ref) == list(range(len(PROMPTS)))
        for i in ref:
            n = len(sj["sequences"][i]) - 1
            assert np.abs(got[i][:n] - ref_same[i][:n]).max() < 2e-5, (name, key, i)
            assert np.abs(got[i][:n] - ref[i][:n]).max() < 2e-5, (name, key, i)  # packed == unpacked


def test_stale_engine_disagreement_and_kl(reference, samples):
    """Replay on: 0 disagreement with the sampled routing; replay off: nonzero. KL(engine || train)
    over the sampled tokens (k3 estimator on the engine's samples) with replay on and off."""
    sj = json.loads(samples.read_text())
    rep = reference
    assert _check_routers(sj, rep, rep["forward_calls"]) > 0  # replay on: exactly the engine's experts
    differ = total = 0
    for n, (col, ids) in enumerate(rep["natural_calls"]):
        for got, want in zip(ids, _expected(sj, rep, n // len(rep["moe_columns"]), col)):
            if want is not None:
                total += 1
                differ += got != want
    rate_off = differ / total
    on, off = _logprobs_by_seq([rep], "logprobs_replay"), _logprobs_by_seq([rep], "logprobs_natural")
    kl = {}
    for key, lps in (("on", on), ("off", off)):
        vals = []
        for i, eng in enumerate(sj["engine_logprobs"]):
            p = sj["prompt_lens"][i]
            train = lps[i][p - 1:p - 1 + len(eng)]
            log_ratio = train - np.asarray(eng)  # log pi_train - log pi_engine on engine samples
            vals.extend(np.exp(log_ratio) - 1 - log_ratio)
        kl[key] = float(np.mean(vals))
    print(f"\n[keep-routing] stale engine: routing disagreement replay-off {rate_off:.3f}, replay-on 0.000; "
          f"KL(engine||train) replay-on {kl['on']:.2e}, replay-off {kl['off']:.2e}")
    assert rate_off > 0.02
    # KL is reported, not ordered: with stale weights the logprob gap comes mostly from the weight
    # change itself; replay makes the gradient flow through the experts that produced the samples.
    assert np.isfinite(kl["on"]) and np.isfinite(kl["off"])
    (samples.parent / "keep_routing_stale.json").write_text(json.dumps({"disagreement_off": rate_off,
                                                                         "disagreement_on": 0.0, "kl": kl}))
