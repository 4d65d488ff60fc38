"""Config loading: field-named errors, profiles, --set overrides, and the CLI's exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from harness import REPO, cli, write_yaml

from batchrl.config import ConfigError, load_pipeline
from batchrl.config.loader import SHIPPED_CONF_DIR

MINIMAL = {
    "name": "t",
    "model": {"path": "some/model"},
    "data": {"train_files": ["prompts/"]},
}


def write(tmp_path: Path, raw: dict, name: str = "p.yaml") -> Path:
    return write_yaml(tmp_path / name, raw)


def test_minimal_pipeline_gets_documented_defaults(tmp_path):
    cfg = load_pipeline(write(tmp_path, MINIMAL))
    assert cfg.run_id == "t"
    assert cfg.generate.num_samples_per_prompt == 4
    assert cfg.advantage.epsilon == 1e-6


def test_unknown_key_is_an_error_naming_the_dotted_field(tmp_path):
    raw = dict(MINIMAL, generate={"temprature": 0.5})
    with pytest.raises(ConfigError, match=r"unknown field 'generate\.temprature'"):
        load_pipeline(write(tmp_path, raw))


def test_wrong_type_names_the_field_and_the_value(tmp_path):
    raw = dict(MINIMAL, generate={"num_samples_per_prompt": "many"})
    with pytest.raises(ConfigError, match=r"generate\.num_samples_per_prompt: .*'many'"):
        load_pipeline(write(tmp_path, raw))


def test_missing_required_section_is_named(tmp_path):
    raw = {k: v for k, v in MINIMAL.items() if k != "model"}
    with pytest.raises(ConfigError, match=r"missing required field 'model'"):
        load_pipeline(write(tmp_path, raw))


def test_group_relative_advantage_needs_two_samples_per_prompt(tmp_path):
    raw = dict(MINIMAL, generate={"num_samples_per_prompt": 1})
    with pytest.raises(ConfigError, match=r"num_samples_per_prompt=1 must be >= 2"):
        load_pipeline(write(tmp_path, raw))


def test_shared_prompts_need_a_token_budget(tmp_path):
    raw = dict(MINIMAL, update={"share_prompt": True})
    with pytest.raises(ConfigError, match=r"update\.share_prompt needs update\.max_tokens_per_micro_batch"):
        load_pipeline(write(tmp_path, raw))
    raw = dict(MINIMAL, update={"share_prompt": True, "max_tokens_per_micro_batch": 4096})
    assert load_pipeline(write(tmp_path, raw)).update.share_prompt


def test_missing_pipeline_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_pipeline(tmp_path / "nope.yaml")


def test_invalid_yaml_reports_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nmodel: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_pipeline(path)


def test_invalid_yaml_names_the_line_an_unclosed_bracket_or_quote_opens_on(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nmodel:\n  path: m\ndata: {train_files: [a, b\ngenerate:\n  temperature: 1\n")
    with pytest.raises(
        ConfigError,
        match=r"bad\.yaml line 4: not valid YAML \(while parsing a flow sequence started "
        r"on this line: .* on line 5\)",
    ):
        load_pipeline(path)
    path.write_text("name: t\nmodel:\n  path: 'm\ndata: {}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml line 3: not valid YAML \(while scanning a quoted scalar"):
        load_pipeline(path)
    path.write_text("name: t\nmodel:\n  path: m\n   bad: 2\n")  # no bracket: the problem's own line
    with pytest.raises(ConfigError, match=r"bad\.yaml line 4: not valid YAML \(mapping values are not allowed"):
        load_pipeline(path)


def test_a_bad_set_key_is_blamed_on_the_set_override_not_the_pipeline_file(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as caught:
        load_pipeline(path, overrides=["generate.temprature=0.7", "run.iterations=0"])
    lines = str(caught.value).splitlines()
    assert sorted(lines) == sorted(
        [
            "--set generate.temprature=0.7: unknown field 'generate.temprature': remove it or check its spelling; "
            "did you mean 'temperature'? (every field: docs/CONFIG.md)",
            "--set run.iterations=0: run.iterations: Input should be greater than or equal to 1 (got 0)",
        ]
    )
    with pytest.raises(ConfigError, match=rf"^{path} \(with --set update.share_prompt=true\): update: "):
        load_pipeline(path, overrides=["update.share_prompt=true"])  # a section's rule, broken by an override
    with pytest.raises(ConfigError, match=rf"^{path}: unknown field 'generate.temprature'"):
        load_pipeline(write(tmp_path, dict(MINIMAL, generate={"temprature": 0.7})))


def test_run_epochs_and_run_iterations_are_one_or_the_other(tmp_path):
    cfg = load_pipeline(write(tmp_path, MINIMAL), overrides=["run.epochs=3"])
    assert cfg.run.epochs == 3
    with pytest.raises(ConfigError, match=r"run\.iterations and run\.epochs both set: set one"):
        load_pipeline(write(tmp_path, MINIMAL), overrides=["run.epochs=3", "run.iterations=2"])
    with pytest.raises(ConfigError, match=r"run\.epochs: Input should be greater than or equal to 1"):
        load_pipeline(write(tmp_path, MINIMAL), overrides=["run.epochs=0"])


def test_set_overrides_win_over_the_file_and_parse_yaml_scalars(tmp_path):
    cfg = load_pipeline(
        write(tmp_path, MINIMAL), overrides=["generate.temperature=0.25", "run.iterations=3", "generate.stop=['</s>']"]
    )
    assert cfg.generate.temperature == 0.25
    assert cfg.run.iterations == 3
    assert cfg.generate.stop == ["</s>"]


def test_malformed_set_override_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_pipeline(write(tmp_path, MINIMAL), overrides=["generate.temperature"])


def test_profiles_merge_under_the_pipeline_file(tmp_path):
    (tmp_path / "conf" / "engine").mkdir(parents=True)
    (tmp_path / "conf" / "engine" / "x.yaml").write_text(
        yaml.safe_dump({"generate": {"engine": "hf", "temperature": 0.1, "max_new_tokens": 7}})
    )
    (tmp_path / "pipelines").mkdir()
    raw = dict(MINIMAL, profiles=["engine/x"], generate={"temperature": 0.9})
    cfg = load_pipeline(write(tmp_path / "pipelines", raw))
    assert cfg.generate.engine == "hf"  # from the profile
    assert cfg.generate.max_new_tokens == 7  # from the profile
    assert cfg.generate.temperature == 0.9  # the pipeline file wins


def test_unknown_profile_says_where_it_looked(tmp_path):
    raw = dict(MINIMAL, profiles=["engine/nope"])
    with pytest.raises(ConfigError, match=r"profile 'engine/nope' not found") as raised:
        load_pipeline(write(tmp_path, raw))
    assert str(tmp_path / "conf" / "engine" / "nope.yaml") in str(raised.value)
    assert str(SHIPPED_CONF_DIR / "engine" / "nope.yaml") in str(raised.value)
    assert "batchrl ships cluster/local, " in str(raised.value) and "BATCHRL_CONF_DIR" in str(raised.value)


def test_the_shipped_profiles_are_found_from_a_pipeline_and_a_directory_outside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BATCHRL_CONF_DIR", raising=False)
    raw = dict(MINIMAL, profiles=["engine/vllm_cpu", "trainer/cpu_gloo", "cluster/local"])
    cfg = load_pipeline(write(tmp_path / "project", raw))
    assert (cfg.generate.engine, cfg.generate.enforce_eager, cfg.update.backend) == ("vllm", True, "gloo")


@pytest.mark.parametrize("where", ["BATCHRL_CONF_DIR", "beside the pipeline file", "in the working directory"])
def test_a_users_own_profile_overrides_the_shipped_one(where, tmp_path, monkeypatch):
    project, cwd = tmp_path / "project", tmp_path / "cwd"
    own_conf = {
        "BATCHRL_CONF_DIR": tmp_path / "my_conf",
        "beside the pipeline file": project / "conf",
        "in the working directory": cwd / "conf",
    }[where]
    write_yaml(own_conf / "engine" / "vllm_cpu.yaml", {"generate": {"engine": "hf"}})
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("BATCHRL_CONF_DIR", raising=False)
    if where == "BATCHRL_CONF_DIR":
        monkeypatch.setenv("BATCHRL_CONF_DIR", str(own_conf))
    cfg = load_pipeline(write(project, dict(MINIMAL, profiles=["engine/vllm_cpu", "trainer/cpu_gloo"])))
    assert cfg.generate.engine == "hf"  # the user's engine/vllm_cpu
    assert cfg.update.backend == "gloo"  # the user has no trainer/cpu_gloo: the shipped one


@pytest.mark.parametrize(
    "pipeline",
    [
        "pipelines/quickstart.yaml",
        "pipelines/grpo_math.yaml",
        "pipelines/ppo_quickstart.yaml",
        "pipelines/ppo_math.yaml",
    ],
)
def test_shipped_pipelines_validate(pipeline):
    cfg = load_pipeline(REPO / pipeline)
    assert cfg.run.iterations >= 2 or cfg.run.epochs >= 2


def test_grpo_math_is_the_real_qwen_job_on_object_storage():
    cfg = load_pipeline(REPO / "pipelines/grpo_math.yaml")
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert all(f.startswith("s3://") for f in cfg.data.train_files)
    assert cfg.generate.engine == "vllm" and cfg.update.backend == "nccl"
    assert (cfg.data.prompts_per_iteration, cfg.update.ppo_mini_batch_size) == (1024, 256)  # verl's recipe shape


def test_ppo_math_is_verls_ppo_example_shape_on_gpus():
    cfg = load_pipeline(REPO / "pipelines/ppo_math.yaml")
    assert cfg.model.path == cfg.critic.model_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.advantage.estimator == "gae" and cfg.advantage.kl_in_reward_coef == 0.001
    assert (cfg.update.lr, cfg.critic.lr) == (1e-6, 1e-5)
    assert cfg.generate.engine == "vllm" and cfg.update.backend == "nccl"
    assert (cfg.data.prompts_per_iteration, cfg.update.ppo_mini_batch_size) == (256, 64)


def test_validate_prints_the_resolved_config():
    result = cli("validate", "pipelines/quickstart.yaml", "--set", "generate.max_new_tokens=9")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["generate"]["max_new_tokens"] == 9
    assert resolved["generate"]["engine"] == "vllm"  # merged from conf/engine/vllm_cpu.yaml


def test_validate_exits_2_with_a_one_line_field_error_and_no_traceback(tmp_path):
    raw = dict(MINIMAL, update={"lr": "fast"})
    result = cli("validate", str(write(tmp_path, raw)))
    assert result.returncode == 2
    assert "update.lr" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_with_a_config_error_exits_2_and_writes_nothing(tmp_path):
    raw = dict(MINIMAL, run={"root": str(tmp_path / "runs")}, bogus=1)
    result = cli("run", str(write(tmp_path, raw)))
    assert result.returncode == 2
    assert "unknown field 'bogus'" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_sleeping_vllm_engines_need_gpus_and_get_sleep_mode_when_they_have_them(tmp_path):
    from batchrl.stages.generate import engine_spec

    raw = dict(MINIMAL, generate={"engine": "vllm", "engine_lifetime": "sleep"})
    with pytest.raises(ConfigError, match=r"generate\.engine_lifetime=sleep needs GPUs for vLLM"):
        load_pipeline(write(tmp_path, raw))
    on_gpus = load_pipeline(write(tmp_path, dict(raw, generate=raw["generate"] | {"gpus_per_actor": 1})))
    assert dict(engine_spec(on_gpus).engine_kwargs)["enable_sleep_mode"] is True
    hf = load_pipeline(write(tmp_path, dict(raw, generate={"engine": "hf", "engine_lifetime": "sleep"})))
    assert hf.generate.engine_lifetime == "sleep"


def test_a_kv_block_size_reaches_the_vllm_engine_and_is_left_to_vllm_by_default(tmp_path):
    from batchrl.stages.generate import engine_spec

    raw = dict(MINIMAL, generate={"engine": "vllm", "kv_block_size": 32})
    assert dict(engine_spec(load_pipeline(write(tmp_path, raw))).engine_kwargs)["block_size"] == 32
    default = load_pipeline(write(tmp_path, dict(MINIMAL, generate={"engine": "vllm"})))
    assert "block_size" not in dict(engine_spec(default).engine_kwargs)


def test_multi_turn_rollouts_on_vllm_cpu_get_32_token_kv_blocks_unless_the_config_says_otherwise(tmp_path):
    from batchrl.stages.generate import engine_spec

    def block_size(generate: dict) -> int | None:
        cfg = load_pipeline(write(tmp_path, dict(MINIMAL, generate=generate)))
        return dict(engine_spec(cfg).engine_kwargs).get("block_size")

    assert block_size({"engine": "vllm", "tools": ["calculator"]}) == 32
    assert block_size({"engine": "vllm", "tools": ["calculator"], "kv_block_size": 128}) == 128
    assert block_size({"engine": "vllm"}) is None  # single-turn: vLLM's own
    assert block_size({"engine": "vllm", "tools": ["calculator"], "gpus_per_actor": 1}) is None  # GPUs: vLLM's 16
    assert block_size({"engine": "hf", "tools": ["calculator"]}) is None  # no KV blocks to size
