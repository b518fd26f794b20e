"""Hydra/OmegaConf schema: composition, typed values, and errors that name the field."""

import os
import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from mrl.config.load import compose
from mrl.config.schema import Config, Dispatcher, ParallelConfig


def test_config_package_imports_without_torch_megatron_sglang():
    code = (
        "import sys\n"
        "for m in ('torch', 'megatron', 'sglang', 'transformers'): sys.modules[m] = None\n"
        "import mrl.config, mrl.config.store, mrl.config.load\n"
        "print(mrl.config.Config().parallel.tp)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_default_composition_is_typed():
    cfg = compose()
    assert isinstance(cfg, Config)
    assert cfg.parallel.tp == 1 and cfg.parallel.dispatcher is Dispatcher.alltoall
    assert cfg.model.hf_path == "runs/models/tiny"


@pytest.mark.parametrize("preset,tp,ep,etp", [("tp2_ep2", 2, 2, 1), ("pp2", 1, 1, None), ("tp2_sp", 2, 1, None)])
def test_parallel_presets(preset, tp, ep, etp):
    cfg = compose([f"parallel={preset}"])
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.etp) == (tp, ep, etp)


def test_experiment_preset_overrides_groups():
    cfg = compose(["+experiment=tiny_tp2_ep2"])
    assert cfg.parallel.tp == 2 and cfg.parallel.ep == 2 and cfg.run_dir == "runs/tiny_tp2_ep2"


def test_invalid_enum_names_field_and_allowed_values():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["parallel.dispatcher=flex"])
    msg = str(e.value) + str(e.value.__cause__)
    assert "parallel.dispatcher" in msg and "alltoall" in msg and "allgather" in msg


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["parallel.eps=4"])
    assert "eps" in str(e.value) + str(e.value.__cause__)


def test_wrong_type_names_field():
    with pytest.raises(ConfigCompositionException) as e:
        compose(["parallel.tp=two"])
    assert "parallel.tp" in str(e.value) + str(e.value.__cause__)


def test_tp_without_sequence_parallel_is_refused():
    with pytest.raises(ValueError, match=r"parallel\.sequence_parallel"):
        compose(["parallel=tp2_sp", "parallel.sequence_parallel=false"])


def test_top_p_range_is_checked():
    with pytest.raises(ValueError, match=r"rollout\.top_p"):
        compose(["rollout.top_p=0"])


def test_collective_timeout_must_outlast_the_batch_wait():
    """Ranks other than 0 wait in the batch broadcast while rank 0 waits for rollouts: a collective limit
    below the batch wait would kill them with a gloo/NCCL timeout instead of rank 0's clear message."""
    with pytest.raises(ValueError, match=r"parallel\.collective_timeout_s.*train\.batch_timeout_s"):
        compose(["train.batch_timeout_s=900", "parallel.collective_timeout_s=600"])
    cfg = compose(["train.batch_timeout_s=900", "parallel.collective_timeout_s=1200"])
    assert (cfg.train.batch_timeout_s, cfg.parallel.collective_timeout_s) == (900, 1200)


def test_world_size_mismatch_names_fields():
    p = ParallelConfig(tp=2, ep=2, etp=1)
    with pytest.raises(ValueError, match=r"parallel\.tp/pp/cp.*world size 3"):
        p.check_world_size(3)
    with pytest.raises(ValueError, match=r"parallel\.world_size"):
        ParallelConfig(tp=2, world_size=4).check_world_size(2)
    with pytest.raises(ValueError, match=r"parallel\.ep/etp/pp"):
        ParallelConfig(tp=1, ep=4).check_world_size(2)


def test_model_sharding_checks_name_fields():
    with pytest.raises(ValueError, match=r"parallel\.ep.*8 experts"):
        ParallelConfig(ep=3).check_model(num_experts=8, num_layers=4, num_query_groups=2)
    with pytest.raises(ValueError, match=r"parallel\.pp.*3 layers"):
        ParallelConfig(pp=2).check_model(num_experts=8, num_layers=3, num_query_groups=2)
    with pytest.raises(ValueError, match=r"parallel\.tp.*KV heads"):
        ParallelConfig(tp=3).check_model(num_experts=8, num_layers=3, num_query_groups=2)
    ParallelConfig(tp=4, ep=8).check_model(num_experts=128, num_layers=48, num_query_groups=4)


def test_invalid_values_fail_at_load_of_resolved_config(tmp_path):
    from mrl.config.load import load_resolved

    p = tmp_path / "config.yaml"
    p.write_text("parallel:\n  dispatcher: nope\n")
    with pytest.raises(ValidationError) as e:
        load_resolved(str(p))
    assert "dispatcher" in str(e.value) and "alltoall" in str(e.value)


def test_lora_experiment_composes():
    cfg = compose(["+experiment=lora_tiny"])
    assert cfg.model.lora.enabled and cfg.model.lora.targets == ["attention"]
    assert cfg.model.tiny_preset.value == "tiny_lora" and cfg.run_dir == "runs/lora_tiny"


@pytest.mark.parametrize("overrides,message", [
    (["engine.lora_max_rank=4"], r"^model\.lora\.rank: 8 > engine\.lora_max_rank 4"),
    (["model.lora.targets=[attention,experts]"], r"^model\.lora\.targets: .*on CPU engines"),
    (["model.lora.targets=[dense_mlp]"], r"^model\.lora\.targets: .*on CPU engines"),
    (["model.lora.targets=[attention,router]"], r"^model\.lora\.targets: 'router'"),
    (["engine.dp=2"], r"^engine\.dp: SGLang loads adapters only"),
    (["+engine.server_args.max_lora_rank=16"], r"^engine\.server_args: \['max_lora_rank'\] are set by mrl"),
    (["+engine.server_args.max_loaded_loras=2"], r"^engine\.server_args\.max_loaded_loras"),
])
def test_lora_engine_refusals_at_config_load(overrides, message):
    """What the engines could not serve is refused when the config loads (``Config.__post_init__``), naming
    the field, not when the engines start minutes later."""
    with pytest.raises(ValueError, match=message):
        compose(["+experiment=lora_tiny", *overrides])


def test_lora_engine_checks_at_load_of_resolved_config(tmp_path):
    """The per-rank workers load the resolved config.yaml: the same refusal there."""
    from mrl.config.load import load_resolved

    p = tmp_path / "config.yaml"
    p.write_text("model:\n  lora: {rank: 8, targets: [experts]}\n")
    with pytest.raises(ValueError, match=r"^model\.lora\.targets: .*on CPU engines"):
        load_resolved(str(p))


def test_expert_lora_accepted_for_gpu_engines():
    """GPU engines serve expert adapters (SGLang's Triton MoE runner): the same targets pass there."""
    cfg = compose(["model.lora.rank=8", "model.lora.targets=[attention,experts]", "engine=gpu", "model.dtype=bf16"])
    assert cfg.model.lora.hf_target_modules[-3:] == ["gate_proj", "up_proj", "down_proj"]


def test_lookup_experiment_is_the_multi_turn_recipe():
    cfg = compose(["+experiment=lookup"])
    assert cfg.data.task == "lookup" and cfg.run_dir == "runs/lookup"
    assert (cfg.train.sft_warmup_steps, cfg.train.steps, cfg.algo.lr) == (70, 300, 3e-4)
    assert compose(["+experiment=lookup", "algo.lr=1e-4"]).algo.lr == 1e-4  # the command line still wins


def test_countdown_opd_experiment_is_the_countdown_recipe_distilled():
    """The countdown recipe's data, warm start and evaluation, distillation alone at its own learning rate."""
    base = compose(["+experiment=countdown"])
    cfg = compose(["+experiment=countdown_opd", "scoring.teacher.hf_path=/teacher"])
    assert (cfg.data, cfg.train.sft_warmup_steps, cfg.train.eval_sets) == (base.data, base.train.sft_warmup_steps,
                                                                           base.train.eval_sets)
    assert cfg.scoring.reward_weight == 0.0 and cfg.scoring.teacher.hf_path == "/teacher"
    assert (cfg.algo.lr, base.algo.lr, cfg.run_dir) == (1e-3, 3e-4, "runs/countdown_opd")


@pytest.mark.parametrize("override, env", [(None, "1"), ("cublas", None), ("cutlass", "1")])
def test_grouped_gemm_kernel_is_the_configs(monkeypatch, override, env):
    """TE reads NVTE_USE_CUTLASS_GROUPED_GEMM at every grouped GEMM; the trainer sets it from
    train.grouped_gemm (CUTLASS by default), over whatever the environment held."""
    from mrl.megatron.model import use_grouped_gemm

    cfg = compose([f"train.grouped_gemm={override}"] if override else [])
    monkeypatch.setenv("NVTE_USE_CUTLASS_GROUPED_GEMM", "0" if env else "1")
    use_grouped_gemm(cfg.train.grouped_gemm)
    assert os.environ.get("NVTE_USE_CUTLASS_GROUPED_GEMM") == env
    with pytest.raises(ConfigCompositionException) as e:
        compose(["train.grouped_gemm=cutlas"])
    assert "train.grouped_gemm" in str(e.value) + str(e.value.__cause__)


def test_residual_add_fused_only_when_there_is_something_to_fuse(tmp_path):
    """No bias and no dropout (every bridge's models): megatron's fused bias-dropout-add would be a
    torch.compile'd add that recompiles for each new sequence length, so it is left off on GPUs too."""
    from mrl.config.schema import TinyPreset
    from mrl.megatron.model import residual_add_fusion
    from mrl.models import get_bridge
    from mrl.models.tiny import make_tiny_model

    assert residual_add_fusion({})  # megatron's defaults: a bias and dropout 0.1
    assert residual_add_fusion({"add_bias_linear": False, "hidden_dropout": 0.1})
    assert residual_add_fusion({"add_bias_linear": True, "hidden_dropout": 0.0})
    assert not residual_add_fusion({"add_bias_linear": False, "hidden_dropout": 0.0})
    for preset in (TinyPreset.tiny_gpu, TinyPreset.deepseek_v3, TinyPreset.glm4_moe):
        path = make_tiny_model(str(tmp_path / preset.value), preset)
        assert not residual_add_fusion(get_bridge(path).transformer_config_kwargs()), preset


def test_trainer_compile_cache_follows_the_engines_unless_set(tmp_path):
    from mrl.compile_cache import cache_env

    assert compose([f"engine.compile_cache_dir={tmp_path}/shared"]).train.compile_cache_dir == f"{tmp_path}/shared"
    apart = compose([f"train.compile_cache_dir={tmp_path}/t"])
    assert apart.train.compile_cache_dir == f"{tmp_path}/t"
    assert apart.engine.compile_cache_dir == "~/.cache/mrl/compile"
    assert compose(["train.compile_cache_dir=null"]).train.compile_cache_dir is None and cache_env(None) == {}
    assert cache_env(f"{tmp_path}/t") == {"TORCHINDUCTOR_CACHE_DIR": f"{tmp_path}/t/inductor",
                                          "TRITON_CACHE_DIR": f"{tmp_path}/t/triton"}
