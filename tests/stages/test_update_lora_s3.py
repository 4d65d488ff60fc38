"""update.lora.init_from_adapter on object storage: the update stage downloads the adapter from S3 (moto's server) and
the first update continues it. One gloo rank on a tiny Qwen2, run by the stage itself (`UpdateStage.run`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_helpers import advantages_manifest, synthetic_rows, write_advantages

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    from batchrl_toy import build_toy_model

    out = tmp_path_factory.mktemp("update_lora_s3") / "base"
    build_toy_model(out, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=0)
    return out


def write_adapter(base: Path, out: Path) -> dict:
    """A PEFT adapter over `base` with B random (a fresh one has B = 0); returns its tensors."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base)),
        LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"]),
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(str(out))
    return load_file(str(out / "adapter_model.safetensors"))


def test_the_first_update_continues_an_init_adapter_downloaded_from_s3(tmp_path, tiny_base, s3_bucket, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    import batchrl.trainer
    from batchrl.config.models import PipelineConfig
    from batchrl.pipeline.stage import StageContext
    from batchrl.stages.update import UpdateStage
    from batchrl.storage import RunLayout, resolve

    init = write_adapter(tiny_base, tmp_path / "init_adapter")
    fs, _ = resolve(f"s3://{s3_bucket}")
    for file in (tmp_path / "init_adapter").iterdir():
        fs.put_file(str(file), f"{s3_bucket}/old/adapter/{file.name}")
    vocab_size = AutoConfig.from_pretrained(str(tiny_base)).vocab_size
    files = write_advantages(synthetic_rows(vocab_size=vocab_size, seed=6), tmp_path / "advantages")
    lora = LORA | {"init_from_adapter": f"s3://{s3_bucket}/old/adapter"}
    cfg = PipelineConfig(
        name="t",
        run={"root": str(tmp_path / "runs"), "iterations": 1},
        model={"path": str(tiny_base)},
        data={"train_files": ["x.parquet"]},
        update={"backend": "gloo", "launcher": "local", "trainer_lifetime": "stage", "lr": 1e-4, "lora": lora},
        tracking={"progress_bars": False},
    )
    layout = RunLayout.for_run(str(tmp_path / "runs"), "t")
    ctx = StageContext(
        cfg=cfg,
        layout=layout,
        iteration=0,
        output_dir=layout.table_dir("policy", 0),
        fingerprint="f",
        inputs={"advantages": advantages_manifest(files)},
        input_dirs={"advantages": str(tmp_path / "advantages")},
        policy_in=str(tiny_base),
    )
    specs, real_run_update = [], batchrl.trainer.run_update

    def recording_run_update(spec, **kwargs):
        specs.append(spec)
        return real_run_update(spec, **kwargs)

    monkeypatch.setattr(batchrl.trainer, "run_update", recording_run_update)
    UpdateStage().run(ctx)

    handed = specs[0].update.lora.init_from_adapter  # the ranks got a local copy, not the URI
    assert not handed.startswith("s3://") and handed.endswith("init_adapter")
    trained = load_file(str(Path(layout.table_dir("policy", 0)) / "adapter" / "adapter_model.safetensors"))
    assert trained.keys() == init.keys()
    for name, tensor in init.items():  # continued: A as it was (a fresh adapter draws a new one), B moved a little
        assert (trained[name] - tensor).abs().max().item() < 0.01, name
    assert any(trained[n].abs().max().item() > 0.1 for n in init if "lora_B" in n)  # a fresh adapter's B is ~0
