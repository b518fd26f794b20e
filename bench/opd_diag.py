"""What a student's on-policy distillation signal looks like: the student samples a recipe's train prompts
(Hugging Face transformers, temperature 1, the recipe's ``rollout.max_new_tokens``), the teacher scores the same
tokens, and the per-token log ratio ``teacher - student`` (the OPD advantage at ``coef`` 1) is summarized: its
quantiles, its mean raw and bounded at ``--clip``, the share of tokens far below 0, the worst tokens in context,
the sampled pass@1 by the recipe's ``reward.fn``, and the norm of the gradient of the OPD surrogate with and
without the bound (which tokens carry the step).

    .venv/bin/python bench/opd_diag.py --student runs/student/hf/final --teacher runs/teacher/hf/final
    .venv/bin/python bench/opd_diag.py --student DIR --teacher DIR --prompts 48 --clip 2 --no-grad

A reading of a checkpoint, not a measurement kept in a report: it prints its figures.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--student", required=True, help="the student's HF checkpoint")
    ap.add_argument("--teacher", required=True, help="the teacher's HF checkpoint (same tokenizer)")
    ap.add_argument("--recipe", default="countdown", help="a conf/experiment/ preset: prompts, reward, lengths")
    ap.add_argument("--prompts", type=int, default=16, help="train prompts, 8 samples each")
    ap.add_argument("--clip", type=float, default=2.0, help="the bound of scoring.teacher.clip to compare")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-grad", action="store_true", help="skip the gradient norms")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from mrl.config.load import compose
    from mrl.data import build_prompt_source, load_tokenizer, prompt_ids
    from mrl.reward import load_reward_fn

    torch.manual_seed(a.seed)
    cfg = compose([f"+experiment={a.recipe}", f"seed={a.seed}"])
    src, tok = build_prompt_source(cfg.data, split="train"), load_tokenizer(a.student)
    reward = load_reward_fn(cfg.reward.fn)
    student = AutoModelForCausalLM.from_pretrained(a.student, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher, dtype=torch.float32).eval()
    eos = student.config.eos_token_id

    def logps(model, ids: list[int], start: int) -> torch.Tensor:
        x = torch.tensor([ids])
        return model(x).logits[0].log_softmax(-1)[start - 1:-1].gather(-1, x[0, start:, None])[:, 0]

    rows, ok = [], []
    with torch.no_grad():
        for i in range(a.prompts):
            p = src.sample(i)
            pid = prompt_ids(p, tok)
            out = student.generate(torch.tensor([pid] * 8), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   max_new_tokens=cfg.rollout.max_new_tokens, eos_token_id=eos, pad_token_id=0)
            for seq in out.tolist():
                resp = seq[len(pid):]
                resp = resp[:resp.index(eos) + 1] if eos in resp else resp
                ok.append(float(reward(p, tok.decode([t for t in resp if t != eos]))))
                rows.append((pid + resp, len(pid)))
        s_lp = [logps(student, ids, st) for ids, st in rows]
        d_rows = [logps(teacher, ids, st) - s for (ids, st), s in zip(rows, s_lp)]
    d = torch.cat(d_rows)
    q = [0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0]
    print(f"{len(rows)} samples, {d.numel()} tokens; sampled pass@1 {sum(ok) / len(ok):.3f}")
    print(f"teacher - student logprob: mean {d.mean():.3f}, bounded at {a.clip:g}: "
          f"{d.clamp(-a.clip, a.clip).mean():.3f}; share < -5: {(d < -5).float().mean():.3f}")
    print("quantiles " + ", ".join(f"{x:g}: {v:.2f}" for x, v in zip(q, d.quantile(torch.tensor(q)).tolist())))
    flat = [(float(v), ids, st, j) for (ids, st), row in zip(rows, d_rows) for j, v in enumerate(row)]
    for v, ids, st, j in sorted(flat, key=lambda x: x[0])[:6]:
        print(f"  {v:6.1f}  {tok.decode(ids[:st])!r} {tok.decode(ids[st:st + j])!r} -> [{tok.decode([ids[st + j]])!r}]")
    if a.no_grad:
        return 0
    for clip in (None, a.clip):  # the OPD surrogate's gradient at ratio 1, per-sequence token mean
        student.zero_grad()
        loss = sum(-(dr.clamp(-clip, clip) if clip else dr) @ logps(student, ids, st) / len(dr)
                   for (ids, st), dr in zip(rows, d_rows)) / len(rows)
        loss.backward()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in student.parameters() if p.grad is not None))
        print(f"gradient norm, {'raw' if clip is None else f'bounded at {clip:g}'}: {norm:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
