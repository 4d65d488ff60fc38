"""update.lora: field-named config errors, target modules checked against the model's own module names before any
work, the update's fingerprint, which only a LoRA pipeline's changes, and the adapter push's config (update.lora.push:
refusals, fingerprints, which adapter a policy is served with)."""

from __future__ import annotations

import shutil

import pytest
from harness import cli, write_yaml
from trainer_helpers import tiny_policy_at

from batchrl.config import ConfigError, load_pipeline
from batchrl.stages.evaluate import EvaluateStage
from batchrl.stages.generate import GenerateStage
from batchrl.stages.generate_adapter import AdapterPush, AdapterServing, policy_label, vllm_max_lora_rank
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


ADAPTER_PUSH = {"lora": {"rank": 4, "push": "adapter"}}


def test_an_adapter_push_with_the_hf_engine_is_refused_naming_both_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"update\.lora\.push=adapter .*generate\.engine is hf"):
        pipeline(tmp_path, update=ADAPTER_PUSH, generate={"engine": "hf"})


def test_an_adapter_push_with_level_2_sleep_exits_2_naming_both_fields_before_any_work(tmp_path):
    gpu_sleep = {"engine": "vllm", "gpus_per_actor": 1, "engine_lifetime": "sleep"}
    pipeline(tmp_path, update={"lora": {"rank": 4}}, generate=gpu_sleep)  # a merged push may sleep
    with pytest.raises(ConfigError, match=r"update\.lora\.push=adapter with generate\.engine_lifetime=sleep.*39934"):
        pipeline(tmp_path, update=ADAPTER_PUSH, generate=gpu_sleep)
    raw = {"name": "t", "model": {"path": "m"}, "data": {"train_files": ["p/"]}, "run": {"root": str(tmp_path / "r")}}
    result = cli("run", str(write_yaml(tmp_path / "s.yaml", raw | {"update": ADAPTER_PUSH, "generate": gpu_sleep})))
    assert result.returncode == 2, result.stderr
    assert "update.lora.push=adapter with generate.engine_lifetime=sleep" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "r").exists()


def test_an_adapter_push_above_the_largest_rank_vllm_serves_is_refused_naming_the_rank(tmp_path):
    pipeline(tmp_path, update={"lora": {"rank": 1024}})  # merged: any rank
    with pytest.raises(ConfigError, match=r"update\.lora\.rank=1024 with update\.lora\.push=adapter"):
        pipeline(tmp_path, update={"lora": {"rank": 1024, "push": "adapter"}})


def test_vllm_gets_the_smallest_max_lora_rank_that_serves_the_rank():
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]


def test_the_push_mode_is_in_generate_and_evaluate_fingerprints_only_when_adapter(tmp_path):
    evaluate = {"evaluate": {"files": ["heldout/"]}}

    def fingerprints(**update):
        cfg = pipeline(tmp_path, update=update, **evaluate)
        return [stage.fingerprint_config(cfg) for stage in (GenerateStage(), EvaluateStage(), UpdateStage())]

    full, merged = fingerprints(), fingerprints(lora={"rank": 4})
    assert fingerprints(lora={"rank": 4, "push": "merged"}) == merged  # the default, spelled out
    assert merged[:2] == full[:2]  # merged: generate and evaluate as before update.lora existed
    adapter = fingerprints(lora={"rank": 4, "push": "adapter"})
    for stage in (0, 1):
        assert adapter[stage] == merged[stage] | {"lora_push": "adapter", "init_from_adapter": None}
    assert adapter[2] == merged[2]  # the update trains the same adapter whichever way the engines get it
    init = fingerprints(lora={"rank": 4, "push": "adapter", "init_from_adapter": "s3://b/adapter"})
    assert init[0]["init_from_adapter"] == "s3://b/adapter"  # iteration 0 generates from it


def test_a_local_init_adapter_without_an_adapter_config_stops_the_run_before_any_work(tmp_path):
    (tmp_path / "not_an_adapter").mkdir()
    cfg = pipeline(tmp_path, update={"lora": {"init_from_adapter": str(tmp_path / "not_an_adapter")}})
    with pytest.raises(ConfigError, match=r"update\.lora\.init_from_adapter=.* holds no adapter_config\.json"):
        UpdateStage().check_inputs(cfg)
    s3 = pipeline(tmp_path, update={"lora": {"init_from_adapter": "s3://bucket/adapter"}})
    UpdateStage().check_inputs(s3)  # object storage is not read before the run: the update downloads it
    assert UpdateStage().read_paths(s3) == [("update.lora.init_from_adapter", "s3://bucket/adapter")]


def test_an_adapter_push_serves_a_policy_adapter_the_initial_adapter_or_the_base(tmp_path, tiny_model):
    base = str(tiny_model)
    push = AdapterPush(AdapterServing(base=base, rank=4, init_from_adapter=None))
    assert push.policy_adapter(base) is None  # iteration 0: the base alone
    carried = shutil.copytree(tiny_model, tmp_path / "t" / "iter_0000" / "policy")  # an update without rows
    assert push.policy_adapter(str(carried)) is None
    (carried / "adapter").mkdir()
    (carried / "adapter" / "adapter_config.json").write_text("{}")
    assert push.policy_adapter(str(carried)) == str(carried / "adapter")
    assert policy_label(str(carried)) == "iter_0000" and policy_label(base) == "initial"
    initial = AdapterPush(AdapterServing(base=base, rank=4, init_from_adapter="runs/x/adapter"))
    assert initial.policy_adapter(base) == "runs/x/adapter"
    other = tmp_path / "other"  # a fully fine-tuned policy (other weights, no adapter)
    build_toy_model(other, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=1)
    with pytest.raises(ValueError, match=r"update\.lora\.push=adapter: the policy .* has no adapter/"):
        push.policy_adapter(str(other))
