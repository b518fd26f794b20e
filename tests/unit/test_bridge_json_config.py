"""The preflight's model check builds the bridge over config.json as written (``JsonConfig``), not over
transformers' config class (whose import costs torch: seconds). These hold the two against each other:
every built-in checkpoint gives the same tensors and sizes, a key config.json leaves to transformers'
defaults sends the check to transformers, and the check imports neither torch nor transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def _facts(bridge) -> dict:
    """What the preflight reads of a bridge."""
    hc = bridge.hf_config
    names = list(bridge.hf_tensor_shapes(bridge.padded_vocab(128, 1)))
    return dict(shapes=bridge.hf_tensor_shapes(bridge.padded_vocab(128, 2)), vocab_size=bridge.vocab_size,
                num_experts=bridge.num_experts, num_layers=bridge.num_layers,
                num_query_groups=bridge.num_query_groups, moe=bridge.moe_layer_pattern(),
                skipped=bridge.skipped_hf_tensors(names + ["model.layers.99.mlp.gate.weight"]),
                special={k: getattr(hc, k, None) for k in SPECIAL})


def test_json_config_bridge_equals_transformers_bridge(ckpt_dir):
    from mrl.models import get_bridge

    for preset, path in sorted(ckpt_dir.items()):
        assert _facts(get_bridge(path, json_config=True)) == _facts(get_bridge(path)), preset


def test_keys_that_may_be_absent_mean_what_transformers_gives():
    """``JsonConfig.ABSENT_OK``: pad_token_id defaults to None in every mapped config class, and Qwen3-MoE's
    num_experts is transformers' alias of num_local_experts (the bridge reads either)."""
    import transformers

    from mrl.models import BRIDGES, JsonConfig

    assert JsonConfig.ABSENT_OK == {"rope_scaling", "rope_parameters", "num_experts", "pad_token_id"}
    for arch in BRIDGES:
        cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
        assert cls().pad_token_id is None, arch
    assert transformers.Qwen3MoeConfig.attribute_map["num_experts"] == "num_local_experts"


def test_string_and_real_keys_are_typed_so_in_transformers():
    """``JsonConfig.TEXT_OR_REAL``: where a mapped config class declares one of these keys, it takes that type
    (a string or real anywhere else is left to transformers' type checks)."""
    import transformers

    from mrl.models import BRIDGES, JsonConfig

    for arch in BRIDGES:
        annotations = {}
        for c in reversed(getattr(transformers, arch.replace("ForCausalLM", "Config")).__mro__):
            annotations.update(getattr(c, "__annotations__", {}))
        for key, kind in JsonConfig.TEXT_OR_REAL.items():
            if key in annotations:
                assert kind.__name__ in str(annotations[key]), (arch, key, annotations[key])


def test_a_value_of_the_wrong_type_is_one_line_from_transformers(ckpt_dir, tmp_path):
    """vocab_size "512": the JSON-config bridge would take it; transformers' config class refuses it."""
    from mrl.config.load import compose
    from mrl.preflight import run_preflight

    path = tmp_path / "tiny"
    shutil.copytree(ckpt_dir["tiny"], path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "vocab_size": "512"}))
    failures = run_preflight(compose([f"model.hf_path={path}", "model.make_tiny_if_missing=false",
                                      f"run_dir={tmp_path / 'run'}"]))
    assert len(failures) == 1 and failures[0].startswith(f"model.hf_path={path}: "), failures
    assert "'vocab_size' expected int, got str" in failures[0], failures


@pytest.mark.parametrize("key", ["num_key_value_heads", "rope_theta_in_parameters"])
def test_a_key_left_to_transformers_defaults_is_decided_by_transformers(ckpt_dir, tmp_path, key):
    """A key config.json lacks (other than ``JsonConfig.ABSENT_OK``) sends the check to transformers' config
    class: without num_key_value_heads its Qwen3-MoE default (4) applies, so the file's k_proj of 2 KV heads is
    mis-shaped; without rope_theta its default applies and the check passes."""
    from mrl.config.load import compose
    from mrl.models import ConfigNeedsTransformers, get_bridge
    from mrl.preflight import check_model

    path = tmp_path / "tiny"
    shutil.copytree(ckpt_dir["tiny"], path)
    raw = json.loads((path / "config.json").read_text())
    if key == "num_key_value_heads":
        del raw["num_key_value_heads"]
    else:
        raw["rope_parameters"].pop("rope_theta")
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigNeedsTransformers):
        _facts(get_bridge(str(path), json_config=True))
    msg = check_model(compose([f"model.hf_path={path}", "model.make_tiny_if_missing=false"]), "local")
    if key == "num_key_value_heads":  # transformers' 4 KV heads: k_proj/v_proj of 4 * 16 rows, the file's 2 * 16
        assert "model.layers.0.self_attn.k_proj.weight has [32, 64], expected [64, 64]" in msg, msg
    else:
        assert msg is None


def test_the_model_check_imports_neither_torch_nor_transformers(ckpt_dir, tmp_path):
    """The preflight's cost on a small CPU box is mostly these imports (seconds); a bridge-level failure and a
    passing check do without them."""
    bad = tmp_path / "no_norm"
    shutil.copytree(ckpt_dir["tiny"], bad)
    from safetensors.torch import load_file, save_file

    t = load_file(bad / "model.safetensors")
    del t["model.norm.weight"]
    save_file(t, bad / "model.safetensors", metadata={"format": "pt"})
    code = (
        "import sys\n"
        "from mrl.config.load import compose\n"
        "from mrl.preflight import check_model\n"
        "for p in sys.argv[1:]:\n"
        "    print(check_model(compose([f'model.hf_path={p}', 'model.make_tiny_if_missing=false']), 'local'))\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code, ckpt_dir["tiny"], str(bad)], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "None" and "missing tensors: ['model.norm.weight']" in lines[1], lines
    assert lines[2] == "[]", lines
