"""The preflight's checks of the ``scoring:`` node (``mrl.preflight.check_reward_fn`` runs them with the job's
import path): user scorers import as ``Scorer`` classes, the checkpoints of the teacher, the PRM and the reference
are there and share the student's tokenizer, the PRM's verdict tokens are one token each, a judge's or reward
model's checkpoint is there and of a kind SGLang serves for it, a judge's template and verdict pattern are usable.
Imports no torch."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import string

from mrl.config.schema import Config
from mrl.config.scoring import ModelScorerConfig
from mrl.scoring.base import Scorer
from mrl.scoring.tokenizer import tokenizer_mismatch


def scoring_problem(cfg: Config) -> str | None:
    """``scoring.scorers`` import as ``mrl.scoring.Scorer`` classes; each enabled pool's checkpoint passes its
    pool's checks (the policy's tokenizer is compared when the policy exists already; a tiny one made at start is
    checked then)."""
    sc = cfg.scoring
    for i, spec in enumerate(sc.scorers):
        module_name, _, attr = spec.cls.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except Exception as e:  # missing module or attribute, or the module raised on import
            return f"scoring.scorers[{i}].cls={spec.cls!r}: cannot import it ({type(e).__name__}: {e})"
        if inspect.isclass(obj) and not issubclass(obj, Scorer):
            return f"scoring.scorers[{i}].cls={spec.cls!r}: {obj.__name__} is not a subclass of mrl.scoring.Scorer"
    for name, pool in sc.pools.items():
        if isinstance(pool, ModelScorerConfig):
            why = model_scorer_problem(name, pool)
        else:
            why = _pool_checkpoint_problem(cfg, pool) or (_verdict_problem(pool) if name == "prm" else None)
        if why:
            return why
    return None


def _pool_checkpoint_problem(cfg: Config, pool) -> str | None:
    """A pool's checkpoint that reads the policy's tokens (teacher, PRM, reference) has a config and a tokenizer,
    the policy's (when the policy exists already)."""
    path = pool.model_path(cfg.model.hf_path)
    if path == cfg.model.hf_path:
        return None  # the policy's own checkpoint (made at start when it is the tiny one)
    for f in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(path, f)):
            return (f"{pool.NODE}.hf_path={path}: no {f} there (a Hugging Face checkpoint with tokenizers' "
                    "tokenizer.json, as the policy's)")
    if os.path.isfile(os.path.join(cfg.model.hf_path, "tokenizer.json")):
        if why := tokenizer_mismatch(cfg.model.hf_path, path):
            return (f"{pool.NODE}.hf_path={path}: it must share the policy's tokenizer "
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


TEMPLATE_FIELDS = ("prompt", "response", "answer")


def template_problem(template: str) -> str | None:
    """Why a judge template is unusable: a placeholder other than {prompt}, {response}, {answer} (or with a
    format spec or an index), unbalanced braces, or no {response}."""
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        return f"cannot be filled in ({e}; write {{{{ and }}}} for literal braces)"
    names = {f for f, _, _ in fields}
    bad = sorted(names - set(TEMPLATE_FIELDS))
    if bad:
        return f"has placeholders {bad}; only {{prompt}}, {{response}} and {{answer}} are filled in"
    if any(spec or conv for _, spec, conv in fields):
        return "placeholders take no format spec or conversion (write {prompt}, not {prompt:>10})"
    if "response" not in names:
        return "has no {response}: the judge would never see the sample"
    return None


def verdict_regex_problem(pattern: str) -> str | None:
    """Why a verdict pattern is unusable: it does not compile, or has no capture group for the verdict."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        return f"does not compile ({e})"
    if compiled.groups < 1:
        return "has no capture group: the verdict is its first group, e.g. '(?i)\\b(yes|no)\\b'"
    return None


def _architectures(path: str) -> list[str]:
    with open(os.path.join(path, "config.json")) as f:
        return list(json.load(f).get("architectures") or [])


def model_scorer_problem(name: str, mcfg) -> str | None:
    """A judge's or reward model's checkpoint has a config and a tokenizer (tokenizer.json), and is a generative
    model (judge) or a classifier SGLang serves on its classification path (reward model); a judge's template
    and verdict pattern are usable."""
    node = mcfg.NODE
    if name == "judge":
        if why := template_problem(mcfg.template):
            return f"{node}.template={mcfg.template!r}: {why}"
        if why := verdict_regex_problem(mcfg.verdict_regex):
            return f"{node}.verdict_regex={mcfg.verdict_regex!r}: {why}"
    for f in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(mcfg.hf_path, f)):
            return (f"{node}.hf_path={mcfg.hf_path}: no {f} there (a Hugging Face checkpoint with tokenizers' "
                    "tokenizer.json)")
    try:
        archs = _architectures(mcfg.hf_path)
    except (OSError, ValueError) as e:
        return f"{node}.hf_path={mcfg.hf_path}: cannot read config.json ({e})"
    classifier = any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs)
    if name == "reward_model" and not classifier:
        return (f"{node}.hf_path={mcfg.hf_path}: architectures {archs} is no reward model; SGLang's /classify serves "
                "*ForSequenceClassification and *ForRewardModel checkpoints (e.g. Qwen3ForSequenceClassification)")
    if name == "judge" and classifier:
        return (f"{node}.hf_path={mcfg.hf_path}: architectures {archs} is a classifier, which writes no verdict; "
                "use it as scoring.reward_model, or give the judge a generative (*ForCausalLM) checkpoint")
    return None
