"""LoRA updates (update.lora) on the tiny policy, 2 gloo ranks: only the adapter trains, the checkpoint holds it in
PEFT's format beside the merged weights, the optimizer state holds the adapter's tensors only, the KL reference is
the base, and a second update continues the first's adapter.

Two updates, shared by the tests: `first` from model.path (a fresh adapter, B = 0), `second` from first's policy
and optimizer state; both recompute the old log-probs and use the KL loss, so the log-probs tables show which model
each pass ran.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from trainer_helpers import load_weights, make_spec, synthetic_rows, tiny_policy_at, write_advantages

from batchrl.trainer import run_update

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
COMMON = dict(backend="gloo", lr=1e-2, kl_loss_coef=0.5, max_tokens_per_micro_batch=64, num_processes=2)


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    """{"base": model.path, "first": (metrics, spec), "second": (metrics, spec)}."""
    from transformers import AutoConfig

    work = tmp_path_factory.mktemp("trainer_lora")
    base = tiny_policy_at(work / "base")
    files = write_advantages(synthetic_rows(vocab_size=AutoConfig.from_pretrained(base).vocab_size), work / "adv")

    def spec(name: str, policy_in: Path, **options):
        return make_spec(
            policy_in=str(policy_in),
            lora_base=str(base),
            reference_policy=str(base),
            lora=LORA,
            policy_out=str(work / name / "policy"),
            trainer_state_out=str(work / name / "state"),
            advantages_files=files,
            metrics_path=str(work / name / "metrics.json"),
            logprobs_dir=str(work / name / "logprobs"),
            **COMMON,
            **options,
        )

    first = spec("first", base)
    runs = {"base": base, "first": (run_update(first, timeout_s=180), first)}
    second = spec("second", Path(first.policy_out), trainer_state_in=first.trainer_state_out)
    runs["second"] = (run_update(second, timeout_s=180), second)
    return runs


def logprobs(spec) -> dict[tuple[str, int], tuple[float, float]]:
    table = pq.read_table(spec.logprobs_dir).to_pylist()
    return {(r["prompt_id"], r["sample_idx"]): (r["old_logprob_sum"], r["ref_logprob_sum"]) for r in table}


def test_the_policy_holds_the_adapter_in_peft_format_and_peft_loads_it(updates):
    from peft import PeftConfig

    adapter = Path(updates["first"][1].policy_out) / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    config = PeftConfig.from_pretrained(str(adapter))
    assert config.r == 4 and set(config.target_modules) == {"q_proj", "v_proj"}


def test_the_merged_checkpoint_is_the_base_plus_the_scaled_adapter_product(updates):
    from safetensors.torch import load_file

    policy = Path(updates["first"][1].policy_out)
    base, merged = load_weights(updates["base"]), load_weights(policy)
    adapter = load_file(str(policy / "adapter" / "adapter_model.safetensors"))
    scale = LORA["alpha"] / LORA["rank"]
    adapted = 0
    for name, weight in base.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in adapter:
            delta = adapter[f"{prefix}.lora_B.weight"] @ adapter[f"{prefix}.lora_A.weight"] * scale
            assert delta.abs().max() > 0, f"{name}: the adapter did not train"
            torch.testing.assert_close(merged[name], weight + delta, rtol=1e-5, atol=1e-6)
            adapted += 1
        else:
            assert torch.equal(merged[name], weight), f"{name} is not adapted and must keep the base's weights"
    assert adapted == 2 * 2  # q_proj and v_proj of the tiny model's two layers


def test_the_optimizer_state_holds_only_the_adapter_tensors(updates):
    from torch.distributed.checkpoint import FileSystemReader

    state = Path(updates["first"][1].trainer_state_out) / "optimizer"
    keys = FileSystemReader(str(state)).read_metadata().state_dict_metadata
    moments = [key for key in keys if key.endswith(".exp_avg")]
    assert moments and all(".lora_A." in key or ".lora_B." in key for key in moments), moments
    assert len(moments) == 2 * 2 * 2  # A and B of four adapted modules


def test_the_reference_is_the_base_model_and_the_second_update_continues_the_first_adapter(updates):
    first, second = logprobs(updates["first"][1]), logprobs(updates["second"][1])
    keys = sorted(first)
    first_old, first_ref = (np.array([first[k][i] for k in keys]) for i in (0, 1))
    second_old, second_ref = (np.array([second[k][i] for k in keys]) for i in (0, 1))
    # a fresh adapter has B = 0: the policy starts as the base
    np.testing.assert_allclose(first_old, first_ref, rtol=1e-5)
    # the reference stays the base after the adapter trained (adapter disabled); the old policy is no longer the
    # base, as it would be with a fresh adapter (B = 0): the first update's adapter was continued
    np.testing.assert_allclose(second_ref, first_ref, rtol=1e-5)
    assert np.abs(second_old - second_ref).max() > 1e-3 * np.abs(second_ref).max()
    assert updates["second"][0]["actor/optimizer_state_restored"] == 1.0
    assert updates["second"][0]["actor/global_step"] == 2 * updates["first"][0]["actor/global_step"]
