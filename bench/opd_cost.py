"""What on-policy distillation's teacher pool costs the loop: the teacher's prefill against the student's
rollouts, engine to engine, and the loop's trained tokens/s with ``scoring=opd`` over the same loop without.

    .venv/bin/python bench/opd_cost.py                                    # CPU: the default run, tiny models
    python3 bench/opd_cost.py --set model=small_gpu engine=gpu engine.base_gpu_id=0 \\
        engine.mem_fraction_static=0.25 weight_sync.transport=tensor ... --teacher-set \\
        scoring.teacher.engine.cpu_mode=false scoring.teacher.engine.base_gpu_id=0 ...   # scripts/gpu/opd_cost.sh

The teacher is the student's own checkpoint (``model.hf_path``): a teacher of equal size, the same tokenizer.

``engines``: one student engine and one teacher engine, both up, from the run's own config (``--set``,
``--teacher-set``). Per round, ``--prompts`` x ``--n`` samples of ``--new`` tokens each (``ignore_eos``, random
prompts of ``--prompt-len`` tokens, fresh each round) go to the student at once, through mrl's client; then the
teacher scores the same samples through the scoring pool (``ScoringPool.input_logprobs``: prefill, no
generation). Reported per round: the student's generated tokens/s, the teacher's scored (response) tokens/s
and prefill (prompt + response) tokens/s, and their ratio ``teacher_scored_over_rollout`` (above 1: one teacher
engine scores faster than one student engine samples).

``loop``: ``mrl train`` without scoring (A) and with ``scoring=opd`` (B) in turns (A B B A ...), ``--rounds``
pairs of ``--steps`` steps. A run's steps after the first ``--skip`` are cut into ``--windows`` windows of equal
steps; a window's trained tokens/s is its ``batch_tokens`` (prompt + response of every trained sample) over its
step seconds. The paired ratios: B's window w over A's window w of the same round, ``rounds x windows`` of them;
``loop_with_scoring_vs_without`` is their median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

from _bench_common import REPORTS, device_name, dump, slug, spread
from recipe_run import REPO, make_models, mrl_command, run_logged


def model_path(sets: list[str]) -> str:
    """The student's checkpoint as the runs see it (relative paths are the repository's)."""
    sys.path.insert(0, REPO)
    from mrl.config.load import compose

    return os.path.join(REPO, compose(sets).model.hf_path)


def teacher_overrides(model_path: str, extra: list[str]) -> list[str]:
    return ["scoring=opd", f"scoring.teacher.hf_path={model_path}", *extra]


# -- engines: teacher prefill against student rollouts ----------------------------------------------

async def _round(student, pool, prompts: list[list[int]], n: int, new: int, rnd: int) -> dict:
    sp = {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(student.generate(p, sp, rid=f"r{rnd}-p{i}-s{j}", return_logprob=True)
                                  for i, p in enumerate(prompts) for j in range(n)))
    gen_s = time.perf_counter() - t0
    seqs = [(prompts[i // n], o.output_ids) for i, o in enumerate(outs)]
    t0 = time.perf_counter()
    scored = await asyncio.gather(*(pool.input_logprobs(p + r, start=len(p), rid=f"t{rnd}-{i}")
                                    for i, (p, r) in enumerate(seqs)))
    score_s = time.perf_counter() - t0
    gen_tokens = sum(len(r) for _, r in seqs)
    assert sum(len(x) for x in scored) == gen_tokens  # every generated token got the teacher's logprob
    prefill_tokens = sum(len(p) + len(r) for p, r in seqs)
    return {"samples": len(seqs), "generated_tokens": gen_tokens, "rollout_seconds": gen_s,
            "score_seconds": score_s, "rollout_tokens_per_s": gen_tokens / gen_s,
            "teacher_scored_tokens_per_s": gen_tokens / score_s,
            "teacher_prefill_tokens_per_s": prefill_tokens / score_s,
            "teacher_scored_over_rollout": gen_s / score_s}


def engines_section(a, sets: list[str], tmp: str) -> dict:
    from mrl.config.load import compose
    from mrl.engine.launcher import engines_from_config
    from mrl.engine.group import EngineGroup
    from mrl.scoring.pool import ScoringPool
    from mrl.sglang.client import ClientTimeouts, EngineClient, close_clients

    model = model_path(sets)
    cfg = compose([*sets, *teacher_overrides(model, a.teacher_set)])
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    log_dir = os.path.join(tmp, "engines")
    student = engines_from_config(cfg.engine, model, log_dir=log_dir, names=["student0"])[0]
    student.return_routed_experts = False
    student.start()
    t = cfg.scoring.teacher
    group = EngineGroup(t.engine, t.model_path(model), log_dir=log_dir, name="teacher",
                        health_timeout_s=t.health_timeout_s)
    pool = ScoringPool(t, group, name="teacher").start()
    rounds = []
    try:
        student.wait_healthy(cfg.scoring.teacher.health_timeout_s)

        async def go():
            client = EngineClient(student.url, timeouts=ClientTimeouts(generate=600.0))
            rng = random.Random(0)
            try:
                for rnd in range(a.engine_rounds + 1):  # round 0 warms both engines up (graphs, caches)
                    prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
                    got = await _round(client, pool, prompts, a.n, a.new, rnd)
                    print(f"[bench] engines round {rnd}: rollout {got['rollout_tokens_per_s']:.0f} tokens/s, teacher "
                          f"scored {got['teacher_scored_tokens_per_s']:.0f} tokens/s (prefill "
                          f"{got['teacher_prefill_tokens_per_s']:.0f})", file=sys.stderr, flush=True)
                    if rnd:
                        rounds.append(got)
            finally:
                await close_clients([client])
                await pool.aclose()

        asyncio.run(go())
    finally:
        pool.close()
        student.stop()
    keys = ("rollout_tokens_per_s", "teacher_scored_tokens_per_s", "teacher_prefill_tokens_per_s",
            "teacher_scored_over_rollout")
    return {"shape": {"prompts": a.prompts, "n": a.n, "prompt_len": a.prompt_len, "new_tokens": a.new},
            "summary": {k: spread([r[k] for r in rounds]) for k in keys}, "rounds": rounds}


# -- loop: trained tokens/s with scoring over without ----------------------------------------------

def loop_run(overrides: list[str], steps: int, run_dir: str, timeout: float) -> dict:
    cmd = [*mrl_command(), "train", f"run_dir={run_dir}", f"train.steps={steps}", "train.eval_every=0",
           "train.save_hf=false", *overrides]
    wall = run_logged(cmd, run_dir, timeout)
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps_rows = [r for r in rows if "step_seconds" in r]
    return {"wall_seconds": wall, "batch_tokens": [r["batch_tokens"] for r in steps_rows],
            "step_seconds": [r["step_seconds"] for r in steps_rows],
            "token_reward": [r.get("token_reward") for r in steps_rows],
            "teacher_groups_failed": steps_rows[-1].get("rollout/scoring_teacher_groups_failed")}


def windows(run: dict, skip: int, n: int) -> list[float]:
    """Trained tokens/s of ``n`` windows of equal steps after the first ``skip``."""
    tok, sec = run["batch_tokens"][skip:], run["step_seconds"][skip:]
    w = len(tok) // n
    if w < 1:
        raise ValueError(f"{len(tok)} steps after --skip {skip} cannot make {n} windows")
    return [sum(tok[i * w:(i + 1) * w]) / sum(sec[i * w:(i + 1) * w]) for i in range(n)]


def loop_section(a, sets: list[str], tmp: str) -> dict:
    model = model_path(sets)
    sides = {"without": sets, "with_opd": [*sets, *teacher_overrides(model, a.teacher_set)]}
    rounds, ratios = [], []
    for i in range(a.rounds):
        order = ["without", "with_opd"] if i % 2 == 0 else ["with_opd", "without"]
        got = {}
        for side in order:
            got[side] = loop_run(sides[side], a.steps, os.path.join(tmp, f"{side}_{i}"), a.timeout)
            got[side]["tokens_per_s_windows"] = windows(got[side], a.skip, a.windows)
            print(f"[bench] loop round {i} {side}: trained tokens/s "
                  f"{statistics.median(got[side]['tokens_per_s_windows']):.0f} (window median), wall "
                  f"{got[side]['wall_seconds']:.0f} s", file=sys.stderr, flush=True)
        got["ratios"] = [b / w for b, w in zip(got["with_opd"]["tokens_per_s_windows"],
                                               got["without"]["tokens_per_s_windows"])]
        ratios += got["ratios"]
        rounds.append({"order": order, **got})
    return {"steps": a.steps, "skip": a.skip, "windows": a.windows, "rounds_run": a.rounds,
            "sides": {k: v[len(sets):] for k, v in sides.items()}, "n_pairs": len(ratios),
            "loop_with_scoring_vs_without": statistics.median(ratios), "ratios": spread(ratios),
            "tokens_per_s": {s: spread([x for r in rounds for x in r[s]["tokens_per_s_windows"]])
                             for s in sides},
            "rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="engines,loop")
    ap.add_argument("--set", nargs="*", default=[], help="overrides of every run (the student's shape)")
    ap.add_argument("--teacher-set", nargs="*", default=[], help="overrides of the teacher pool (scoring.teacher.*)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--engine-rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=2, help="first steps of a run left out (the pipeline fills)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--keep", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = a.keep or tempfile.mkdtemp(prefix="mrl-opd-cost-")
    os.makedirs(tmp, exist_ok=True)
    sets = [*a.set, *make_models(a.set, tmp)]
    result = {"bench": "opd_cost", "sets": a.set, "teacher_set": a.teacher_set,
              "teacher": "the student's own checkpoint (equal size, same tokenizer)"}
    sections = a.sections.split(",")
    if "engines" in sections:
        result["engines"] = engines_section(a, sets, tmp)
    if "loop" in sections:
        result["loop"] = loop_section(a, sets, tmp)
        result["loop_with_scoring_vs_without"] = result["loop"]["loop_with_scoring_vs_without"]
    if "engines" in sections:
        result["teacher_scored_over_rollout"] = result["engines"]["summary"]["teacher_scored_over_rollout"]["median"]
    name = f"opd_cost_{slug(device_name())}"
    out = a.out or os.path.join(REPORTS, "loop", f"{time.strftime('%Y-%m-%d', time.gmtime())}_{name}.json")
    dump(result, out, name=f"opd_cost_{slug(device_name())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
