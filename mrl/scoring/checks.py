"""The preflight's checks of the ``scoring:`` node (``mrl.preflight.check_reward_fn`` runs them with the job's
import path): user scorers import as ``Scorer`` classes, a teacher's checkpoint is there and shares the student's
tokenizer. Imports no torch."""

from __future__ import annotations

import importlib
import inspect
import os

from mrl.config.schema import Config
from mrl.scoring.base import Scorer
from mrl.scoring.tokenizer import tokenizer_mismatch


def scoring_problem(cfg: Config) -> str | None:
    """``scoring.scorers`` import as ``mrl.scoring.Scorer`` classes; a teacher's checkpoint has a config and a
    tokenizer, the student's tokenizer (when the student exists already; a tiny one made at start is checked
    then)."""
    sc = cfg.scoring
    for i, spec in enumerate(sc.scorers):
        module_name, _, attr = spec.cls.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except Exception as e:  # missing module or attribute, or the module raised on import
            return f"scoring.scorers[{i}].cls={spec.cls!r}: cannot import it ({type(e).__name__}: {e})"
        if inspect.isclass(obj) and not issubclass(obj, Scorer):
            return f"scoring.scorers[{i}].cls={spec.cls!r}: {obj.__name__} is not a subclass of mrl.scoring.Scorer"
    t = sc.teacher
    if not t.enabled:
        return None
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(t.hf_path, name)):
            return (f"scoring.teacher.hf_path={t.hf_path}: no {name} there (a Hugging Face checkpoint with "
                    "tokenizers' tokenizer.json, as the student's)")
    if os.path.isfile(os.path.join(cfg.model.hf_path, "tokenizer.json")):
        if why := tokenizer_mismatch(cfg.model.hf_path, t.hf_path):
            return (f"scoring.teacher.hf_path={t.hf_path}: the teacher must share the student's tokenizer "
                    f"(model.hf_path={cfg.model.hf_path}): {why}")
    return None
