"""Whether a teacher shares the student's tokenizer (on-policy distillation scores the student's token ids
with the teacher: the same ids must mean the same tokens). Reads files only; imports no torch."""

from __future__ import annotations

import json
import os


def tokenizer_mismatch(student_dir: str, teacher_dir: str) -> str | None:
    """Why the teacher's tokenizer is not the student's (tokenizer.json vocabularies, added tokens and the
    EOS/BOS ids of config.json compared), or None when they are the same."""
    from tokenizers import Tokenizer

    try:
        toks = [Tokenizer.from_file(os.path.join(d, "tokenizer.json")) for d in (student_dir, teacher_dir)]
    except Exception as e:  # missing or unreadable: the message says which
        return f"cannot read both tokenizers ({type(e).__name__}: {e})"
    student, teacher = (t.get_vocab(with_added_tokens=True) for t in toks)
    if student != teacher:
        only_s, only_t = set(student) - set(teacher), set(teacher) - set(student)
        moved = [k for k in set(student) & set(teacher) if student[k] != teacher[k]]
        return (f"vocabularies differ: {len(student)} tokens against {len(teacher)}, {len(only_s)} only in the "
                f"student's, {len(only_t)} only in the teacher's, {len(moved)} with other ids "
                f"(e.g. {sorted(only_s | only_t | set(moved))[:3]})")
    ids = []
    for d in (student_dir, teacher_dir):
        try:
            with open(os.path.join(d, "config.json")) as f:
                c = json.load(f)
        except (OSError, ValueError) as e:
            return f"cannot read {d}/config.json ({e})"
        ids.append({k: c.get(k) for k in ("eos_token_id", "bos_token_id")})
    if ids[0] != ids[1]:
        return f"special token ids differ: student {ids[0]}, teacher {ids[1]}"
    return None
