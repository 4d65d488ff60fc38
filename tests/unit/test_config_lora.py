"""update.lora: field-named config errors, target modules checked against the model's own module names before any
work, and the update's fingerprint, which only a LoRA pipeline's changes."""

from __future__ import annotations

import shutil

import pytest
from harness import write_yaml
from trainer_helpers import tiny_policy_at

from batchrl.config import ConfigError, load_pipeline
from batchrl.stages.update import UpdateStage
from batchrl.trainer.lora import adapter_source, model_module_names, unmatched_targets
from batchrl_toy import build_toy_model


def pipeline(tmp_path, model_path="some/model", **sections):
    raw = {"name": "t", "model": {"path": str(model_path)}, "data": {"train_files": ["prompts/"]}, **sections}
    return load_pipeline(write_yaml(tmp_path / "p.yaml", raw))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_policy_at(tmp_path_factory.mktemp("lora_model") / "model")


def test_a_rank_below_one_is_an_error_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"update\.lora\.rank"):
        pipeline(tmp_path, update={"lora": {"rank": 0}})


def test_an_empty_target_list_is_an_error_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"update\.lora\.target_modules"):
        pipeline(tmp_path, update={"lora": {"target_modules": []}})


def test_a_critic_with_lora_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"update\.lora .*critic"):
        pipeline(tmp_path, update={"lora": {}}, advantage={"estimator": "gae"}, critic={})


def test_target_names_match_as_peft_matches_them():
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "lm_head"]
    assert unmatched_targets(names, ["q_proj", "self_attn.q_proj", "up_proj"]) == []
    assert unmatched_targets(names, ["q_pro", "k_proj", "q_proj"]) == ["q_pro", "k_proj"]
    assert unmatched_targets(names, "all-linear") == []


def test_a_target_that_matches_no_module_of_the_model_stops_the_run_before_any_work(tmp_path, tiny_model):
    assert "model.layers.1.self_attn.v_proj" in model_module_names(str(tiny_model))
    cfg = pipeline(tmp_path, tiny_model, update={"lora": {"target_modules": ["q_proj", "query"]}})
    with pytest.raises(ConfigError, match=r"update\.lora\.target_modules: \['query'\] match no module"):
        UpdateStage().check_inputs(cfg)
    for targets in (["q_proj", "v_proj"], "all-linear"):
        UpdateStage().check_inputs(pipeline(tmp_path, tiny_model, update={"lora": {"target_modules": targets}}))


def test_only_a_lora_pipeline_has_lora_in_its_update_fingerprint(tmp_path):
    def fingerprint(**update):
        return UpdateStage().fingerprint_config(pipeline(tmp_path, update=update))

    assert "lora" not in fingerprint()["update"]
    assert fingerprint(lora={"rank": 4}) != fingerprint(lora={"rank": 8}) != fingerprint()


def test_an_update_continues_the_input_policy_adapter_and_refuses_other_full_weights(tmp_path, tiny_model):
    base = str(tiny_model)
    assert adapter_source(base, lora_base=base, init_from_adapter=None) is None  # iteration 0: a fresh adapter
    assert adapter_source(base, lora_base=base, init_from_adapter="runs/x/adapter") == "runs/x/adapter"
    carried = shutil.copytree(tiny_model, tmp_path / "carried")  # an update without rows copies its input
    assert adapter_source(str(carried), lora_base=base, init_from_adapter=None) is None
    (carried / "adapter").mkdir()
    (carried / "adapter" / "adapter_config.json").write_text("{}")
    assert adapter_source(str(carried), lora_base=base, init_from_adapter="ignored") == str(carried / "adapter")
    other = tmp_path / "other"  # a fully fine-tuned policy (other weights, no adapter)
    build_toy_model(other, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=1)
    with pytest.raises(ValueError, match=r"has no adapter/ and is not model\.path"):
        adapter_source(str(other), lora_base=base, init_from_adapter=None)
