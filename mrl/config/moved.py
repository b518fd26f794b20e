"""Keys that moved or went away (those that left the ``rollout:`` node, ``train.eval_prompts``), refused with
what replaced them. A command-line override, a YAML preset or experiment, or a run directory's
``config.yaml`` that sets one fails before anything starts, with one line naming the old key and the new one::

    mrl train rollout.num_engines=2   ->  rollout.num_engines moved to engine.count
    mrl train rollout=gpu_tp8         ->  rollout=gpu_tp8 moved to engine=gpu_tp8 rollout=long

Values whose meaning a new name now states are refused the same way (``algo.correction_level=sequence``).
"""

from __future__ import annotations

from typing import Optional

_RENAMED = {"num_engines": "count", "engine_tp": "tp", "engine_ep": "ep", "engine_dp": "dp", "engine_dtype": "dtype",
            "restart_engines": "max_restarts", "engine_urls": "urls", "engine_url_dir": "url_dir"}
_SAME_NAME = ("cpu_mode", "cpu_batched_attention", "memory_saver", "base_gpu_id", "mem_fraction_static",
              "attention_backend", "sampling_backend", "max_total_tokens", "quantization", "compile_cache_dir",
              "fp8_ignore", "moe_kernel_configs", "kv_cache_dtype", "max_running_requests", "cpus", "cpu_threads",
              "server_args", "lora_max_rank", "lora_slots", "lora_backend")
MOVED = {f"rollout.{old}": f"engine.{new}" for old, new in {**_RENAMED, **{k: k for k in _SAME_NAME}}.items()}
"""Old key -> new key."""
REMOVED = {"rollout.client_process": "the rollout client always runs in its own process",
           "algo.mis_low": "masked IS (algo.correction=mis) rejects only sequences whose weight exceeds "
                           "algo.mis_high, as its paper does; a two-sided band per token is algo.correction=icepop "
                           "(icepop_low/icepop_high)",
           "train.eval_prompts": "each evaluation set has its own, train.eval_sets.<i>.max_prompts"}
"""Old key -> why it has no successor."""
MOVED_VALUES = {("algo.correction_level", "sequence"):
                "algo.correction_level=sequence (the geometric mean of the token ratios) is now sequence_geomean; "
                "sequence_product is the unbiased product of the token ratios"}
"""(key, old value) -> what it is called now."""
MOVED_PRESETS = {"rollout/cpu": "engine=cpu", "rollout/gpu": "engine=gpu",
                 "rollout/gpu_tp8": "engine=gpu_tp8 rollout=long"}
"""Old preset (group/name) -> the preset that replaces it."""


def moved_value_message(key: str, value) -> Optional[str]:
    """What became of ``key=value`` when the value was renamed, or None."""
    return MOVED_VALUES.get((key, str(value)))


class MovedKeyError(ValueError):
    """A config sets a key or preset that moved or went away; the message names what replaced it."""


def moved_key_message(key: str) -> Optional[str]:
    """What became of a dotted key (``rollout.num_engines``, ``rollout.server_args.port``), or None when
    it did not move."""
    for old, new in MOVED.items():
        if key == old or key.startswith(old + "."):
            return f"{key} moved to {new}{key[len(old):]}"
    for old, why in REMOVED.items():
        if key == old or key.startswith(old + "."):
            return f"{key} was removed: {why}"
    return None


def moved_preset_message(group_path: str) -> Optional[str]:
    """What became of a preset named as ``group/name`` (``rollout/gpu_tp8``), or None."""
    new = MOVED_PRESETS.get(group_path.removesuffix(".yaml"))
    return f"{group_path.replace('/', '=', 1)} moved to {new}" if new else None


def check_overrides(overrides: list[str]) -> None:
    """Refuse command-line overrides that set a moved key or choose a moved preset
    (``rollout.num_engines=2``, ``+rollout.server_args.x=1``, ``~rollout.cpus``, ``rollout=gpu``)."""
    for item in overrides:
        if item.startswith("-") or "=" not in item and not item.startswith("~"):
            continue  # a Hydra flag (--cfg job, -cd DIR) or a bare word
        key, _, value = item.partition("=")
        key = key.lstrip("+~").partition("@")[0]
        msg = moved_preset_message(f"{key}/{value}") if key == "rollout" else moved_key_message(key)
        if msg := msg or moved_value_message(key, value):
            raise MovedKeyError(msg)


def explain(error: BaseException) -> Optional[MovedKeyError]:
    """The moved key behind a composition or merge error (Hydra's or OmegaConf's, which name the key as
    ``full_key`` or the missing preset as ``missing_cfg_file``), or None when no moved key caused it."""
    seen: set[int] = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MovedKeyError):
            return e
        msg = None
        if full_key := getattr(e, "full_key", None):
            msg = moved_key_message(str(full_key)) or moved_value_message(str(full_key), getattr(e, "value", None))
        if not msg and (missing := getattr(e, "missing_cfg_file", None)):
            msg = moved_preset_message(str(missing))
        if msg:
            return MovedKeyError(msg)
        e = e.__cause__ or e.__context__
    return None
