"""Proof that a judge engine's reward drives a run that learns: a tiny generative judge is trained (transformers,
a few minutes on CPU) to answer YES or NO to "is this response to the copy_last task correct?", then
``mrl train`` runs with that judge, served by SGLang engines the run starts, as its only reward
(``scoring=judge``, ``scoring.reward_weight=0``: ``reward.fn`` never runs), next to the same run trained on
``exact_match`` itself. Both are measured on the held-out split with ``exact_match`` (``train.eval_sets``).

    .venv/bin/python bench/judge_learning.py --keep /tmp/judge_runs

Writes bench/reports/learning/<date>_mrl_train_judge_<hardware>.json and the plot beside it: the judge's own
accuracy against ``exact_match`` on held-out pairs, and per run the held-out greedy pass@1 over the steps and
the training reward (the judge's verdicts, or exact_match).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from _bench_common import REPORTS, device_name, dump, slug
from recipe_run import plot, run_logged, summarize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TEMPLATE = "{prompt} reference {answer} response {response} verdict:"
VERDICTS = {True: " YES", False: " NO"}


def candidate(rng: random.Random, answer: str, vocab: list[str], alphabet: str) -> str:
    """A response as a policy might write one: the answer, another letter, the answer with junk after it, a few
    random tokens of the tokenizer's, or nothing (EOS at once: a judge never shown an empty response says YES
    to it about half the time, and the policy learns to write nothing)."""
    u = rng.random()
    if u < 0.1:
        return rng.choice(["", " ", "\n"])
    if u < 0.45:
        return answer
    if u < 0.65:
        return rng.choice([c for c in alphabet if c != answer])
    if u < 0.8:
        return answer + "".join(rng.choice(vocab) for _ in range(rng.randint(1, 3)))
    return "".join(rng.choice(vocab) for _ in range(rng.randint(1, 4)))


def judge_examples(n: int, seed: int, split: str):
    from mrl.data.tasks import build_task
    from mrl.reward.builtin import exact_match

    task = build_task("copy_last", split=split, seed=seed)
    from mrl.models.tiny import build_tokenizer

    tok = build_tokenizer(512)
    vocab = [tok.decode([i]) for i in range(4, 512)]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = task.sample(i)
        resp = candidate(rng, p.answer, vocab, "abcdef")
        out.append((p, resp, bool(exact_match(p, resp))))
    return out


def train_judge(out_dir: str, steps: int, seed: int = 0, start: str | None = None) -> dict:
    """A dense 2-layer Qwen3 (the tiny tokenizer) trained on (template, verdict) pairs, from scratch or from the
    judge at ``start``; returns its accuracy against exact_match on pairs of the held-out prompts."""
    import torch
    import transformers

    from mrl.models.tiny import PRESETS, TINY_CONTEXT, build_tokenizer
    from mrl.scoring.judge import render

    from mrl.config.schema import TinyPreset

    p = PRESETS[TinyPreset.tiny]
    cfg = transformers.Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        head_dim=32, num_key_value_heads=2, rope_theta=p["rope_theta"], rms_norm_eps=p["rms_norm_eps"],
        max_position_embeddings=TINY_CONTEXT, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    model = (transformers.Qwen3ForCausalLM.from_pretrained(start, dtype=torch.float32) if start
             else transformers.Qwen3ForCausalLM(cfg).float())
    tok = build_tokenizer(512)

    def encode(ex):
        prompt, resp, ok = ex
        ids = tok.encode(render(TEMPLATE, prompt=prompt.text, response=resp, answer=prompt.answer)).ids
        tgt = tok.encode(VERDICTS[ok]).ids + [2]
        return ids, tgt

    train = [encode(e) for e in judge_examples(20000, seed, "train")]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    rng = random.Random(seed)
    t0, losses = time.monotonic(), []
    model.train()
    for step in range(steps):
        batch = rng.sample(train, 64)
        seqs = [a + b for a, b in batch]
        width = max(map(len, seqs))
        x = torch.zeros(len(seqs), width, dtype=torch.long)
        y = torch.full((len(seqs), width), -100, dtype=torch.long)
        att = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, ((a, b), s) in enumerate(zip(batch, seqs)):
            x[i, :len(s)] = torch.tensor(s)
            att[i, :len(s)] = 1
            y[i, len(a):len(s)] = torch.tensor(b)
        loss = model(input_ids=x, attention_mask=att, labels=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % 100 == 0:
            print(f"[judge] step {step} loss {statistics.mean(losses[-100:]):.4f}", file=sys.stderr, flush=True)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return {"steps": steps, "started_from": start, "train_seconds": time.monotonic() - t0,
            "loss_last100": statistics.mean(losses[-100:]), **judge_accuracy(out_dir, seed + 1)}


def judge_accuracy(judge_dir: str, seed: int, n: int = 400) -> dict:
    """The judge's verdicts (greedy, as the run asks) against exact_match on pairs of the held-out prompts, and on
    empty responses alone."""
    import torch
    import transformers

    from mrl.models.tiny import build_tokenizer
    from mrl.scoring.judge import render

    tok = build_tokenizer(512)
    model = transformers.Qwen3ForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()

    def says_yes(p, resp) -> bool:
        a = tok.encode(render(TEMPLATE, prompt=p.text, response=resp, answer=p.answer)).ids
        with torch.no_grad():
            out = model.generate(torch.tensor([a]), max_new_tokens=6, do_sample=False, pad_token_id=0)
        return "YES" in tok.decode(out[0, len(a):].tolist(), skip_special_tokens=True)

    held = judge_examples(n, seed, "eval")
    right = sum(says_yes(p, r) == ok for p, r, ok in held)
    empty_yes = sum(says_yes(p, "") for p, _, _ in held[:50])
    return {"heldout_accuracy_vs_exact_match": right / len(held), "heldout_pairs": len(held),
            "heldout_share_correct": sum(e[2] for e in held) / len(held), "empty_response_yes_share": empty_yes / 50}


def run(name: str, overrides: list[str], run_dir: str, timeout: float) -> dict:
    """One ``mrl train`` run's figures; kept beside the run directory, so that a later call reports it again."""
    cached = run_dir + ".result.json"
    if os.path.exists(cached):
        return json.load(open(cached))
    cmd = [sys.executable, "-m", "mrl", "train", f"run_dir={run_dir}", "train.save_hf=false", *overrides]
    wall = run_logged(cmd, run_dir, timeout)
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl"))]
    got = summarize(rows, "heldout")
    judge = {k: v for k, v in rows[-1].items() if k.startswith("rollout/scoring_")} if rows else {}
    print(f"[bench] {name}: greedy pass@1 {got['heldout_pass_at_1_start']:.3f} -> {got['heldout_pass_at_1_end']:.3f}, "
          f"wall {wall:.0f} s", file=sys.stderr, flush=True)
    out = {"variant": name, "seed": 1234, "overrides": overrides, "wall_seconds": wall, "scoring_stats": judge, **got}
    json.dump(out, open(cached, "w"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", default="/tmp/mrl-judge-learning")
    ap.add_argument("--judge-steps", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--only", nargs="*", default=["judge", "exact_match"], help="the runs to make and report")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--set", nargs="*", default=[
        "train.eval_sets=[{name: heldout, max_prompts: 64, greedy: true, n: 8, k: [1]}]"],
        help="overrides of every run (default: held-out greedy pass@1 and sampled pass@1 of 8 samples a prompt)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--judge-from", default=None, help="continue training this judge instead of a fresh one")
    ap.add_argument("--judge-name", default="judge_model")
    ap.add_argument("--include", default=None, help="an earlier report whose runs are added (those also run now "
                    "under a prefixed name)")
    ap.add_argument("--include-prefix", default="v1_")
    ap.add_argument("--include-judge", default=None, help="the earlier report's judge, measured again here")
    a = ap.parse_args()
    os.makedirs(a.keep, exist_ok=True)
    judge_dir = os.path.join(a.keep, a.judge_name)
    info_path = judge_dir + ".json"
    if not os.path.exists(info_path):
        json.dump(train_judge(judge_dir, a.judge_steps, start=a.judge_from), open(info_path, "w"))
    judge = json.load(open(info_path))
    print(f"[bench] judge: {judge}", file=sys.stderr, flush=True)
    common = [f"train.steps={a.steps}", *a.set]
    variants = {
        "judge": ["scoring=judge", f"scoring.judge.hf_path={judge_dir}", f"scoring.judge.template='{TEMPLATE}'",
                  "scoring.judge.max_new_tokens=4"],
        "exact_match": [],
    }
    variants["judge"][1] = f"scoring.judge.hf_path={judge_dir}"
    runs = [run(n, common + variants[n], os.path.join(a.keep, f"{n}_{a.judge_name}" if n == "judge" else n),
                a.timeout) for n in a.only]
    earlier = {}
    if a.include:
        earlier = json.load(open(a.include))
        runs += [dict(r, variant=a.include_prefix + r["variant"]) if r["variant"] in a.only else r
                 for r in earlier["runs"]]
    name = f"mrl_train_judge_copy_last_{slug(device_name())}"
    out = a.out or os.path.join(REPORTS, "learning", f"{time.strftime('%Y-%m-%d', time.gmtime())}_{name}.json")
    plot(runs, out.removesuffix(".json") + ".png", f"copy_last, reward = a judge engine's verdict vs exact_match "
         f"({device_name()})")
    dump({"task": "copy_last", "judge_template": TEMPLATE, "judge": judge,
          "earlier": {"report": a.include, "judge": earlier.get("judge"), "judge_measured_again": (
              judge_accuracy(a.include_judge, 1) if a.include_judge else None)} if a.include else None,
          "summary": {r["variant"]: {"heldout_pass_at_1_start": r["heldout_pass_at_1_start"],
                                     "heldout_pass_at_1_end": r["heldout_pass_at_1_end"],
                                     "lift": r["heldout_pass_at_1_end"] - r["heldout_pass_at_1_start"],
                                     "heldout_metric": "sampled pass@1, 8 a prompt" if r["evaluations"][0].get(
                                         "pass_at_1") is not None else "greedy pass@1",
                                     "heldout_greedy_pass_at_1_start": r["heldout_greedy_pass_at_1_start"],
                                     "heldout_greedy_pass_at_1_end": r["heldout_greedy_pass_at_1_end"],
                                     "train_reward_first10": r["reward_first10"],
                                     "train_reward_last10": r["reward_last10"],
                                     "wall_seconds": r["wall_seconds"]} for r in runs},
          "runs": runs}, out, name=f"mrl_train_judge_copy_last_{slug(device_name())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
