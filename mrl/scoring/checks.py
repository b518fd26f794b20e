"""The preflight's checks of the ``scoring:`` node (``mrl.preflight.check_reward_fn`` runs them with the job's
import path): user scorers import as ``Scorer`` classes, the checkpoints of the teacher, the PRM and the reference
are there and share the student's tokenizer, the PRM's verdict tokens are one token each. Imports no torch."""

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
    if sc.prm.enabled and (why := _pool_checkpoint_problem(cfg, "prm", sc.prm.hf_path) or _verdict_problem(sc.prm)):
        return why
    if sc.reference.enabled and (why := _pool_checkpoint_problem(cfg, "reference",
                                                                 sc.reference.hf_path or cfg.model.hf_path)):
        return why
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


def _pool_checkpoint_problem(cfg: Config, name: str, path: str) -> str | None:
    """A scoring pool's checkpoint has a config and a tokenizer, the policy's (when the policy exists already)."""
    if path == cfg.model.hf_path:
        return None  # the policy's own checkpoint (made at start when it is the tiny one)
    for f in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(path, f)):
            return (f"scoring.{name}.hf_path={path}: no {f} there (a Hugging Face checkpoint with tokenizers' "
                    "tokenizer.json, as the policy's)")
    if os.path.isfile(os.path.join(cfg.model.hf_path, "tokenizer.json")):
        if why := tokenizer_mismatch(cfg.model.hf_path, path):
            return (f"scoring.{name}.hf_path={path}: it must share the policy's tokenizer "
                    f"(model.hf_path={cfg.model.hf_path}): {why}")
    return None


def _verdict_problem(prm) -> str | None:
    """The PRM's verdict tokens are one token each of its tokenizer."""
    from tokenizers import Tokenizer

    from mrl.scoring.process_reward import one_token

    tok = Tokenizer.from_file(os.path.join(prm.hf_path, "tokenizer.json"))
    try:
        one_token(tok, prm.good_token, "good_token")
        one_token(tok, prm.bad_token, "bad_token")
    except ValueError as e:
        return str(e)
    return None
