"""The trainer's GPU-only paths (NCCL, CPU offload, bf16 on CUDA). Marked `gpu`; skipped without a CUDA GPU
(the development machines have none: run on a GPU host or in a device check)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from trainer_helpers import load_weights, make_spec, respec, synthetic_rows, write_advantages

from batchrl.trainer import UpdateSpec, run_update

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


@pytest.fixture(scope="module")
def base_spec(tmp_path_factory) -> UpdateSpec:
    from transformers import AutoConfig

    from batchrl_toy import build_toy_model

    workdir = tmp_path_factory.mktemp("trainer_gpu")
    build_toy_model(
        workdir / "policy_in",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        seed=0,
    )
    vocab_size = AutoConfig.from_pretrained(str(workdir / "policy_in")).vocab_size
    files = write_advantages(synthetic_rows(vocab_size=vocab_size), workdir / "advantages")
    return make_spec(
        policy_in=str(workdir / "policy_in"),
        policy_out=str(workdir / "plain" / "policy"),
        advantages_files=files,
        metrics_path=str(workdir / "plain" / "metrics.json"),
        backend="nccl",
        lr=1e-4,
        ppo_mini_batch_size=2,
        ppo_epochs=2,
        max_tokens_per_micro_batch=40,
        kl_loss_coef=0.1,
        reference_policy=str(workdir / "policy_in"),
        trainer_state_out=str(workdir / "plain" / "state"),
    )


def with_outputs(spec: UpdateSpec, name: str, **options) -> UpdateSpec:
    out = Path(spec.policy_out).parent.parent / name
    return respec(
        spec,
        policy_out=str(out / "policy"),
        metrics_path=str(out / "metrics.json"),
        trainer_state_out=str(out / "state"),
        **options,
    )


def test_cpu_offload_on_nccl_trains_the_same_weights_as_without_it(base_spec):
    offload = with_outputs(base_spec, "offload", cpu_offload=True)
    metrics = run_update(offload, timeout_s=300)
    run_update(base_spec, timeout_s=300)

    assert all(math.isfinite(v) for v in metrics.values())
    plain, offloaded = load_weights(Path(base_spec.policy_out)), load_weights(Path(offload.policy_out))
    assert max((plain[k] - offloaded[k]).abs().max().item() for k in plain) < 1e-5


def test_a_bf16_checkpointed_nccl_update_resumes_from_its_optimizer_state(base_spec):
    first = with_outputs(base_spec, "bf16_first", dtype="bfloat16", gradient_checkpointing=True)
    run_update(first, timeout_s=300)
    second = with_outputs(first, "bf16_second", policy_in=first.policy_out, trainer_state_in=first.trainer_state_out)
    metrics = run_update(second, timeout_s=300)

    assert metrics["actor/optimizer_state_restored"] == 1 and metrics["actor/global_step"] == 8
    assert all(math.isfinite(v) for v in metrics.values())
