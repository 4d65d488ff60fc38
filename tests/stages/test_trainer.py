"""The FSDP2 policy update, run for real in subprocesses on a tiny Qwen2 (gloo on CPU).

The core claim: 2 processes produce the same weights as 1 (global loss normalisation per mini-batch + summed
gradients), both for plain PPO and with everything on (mini-batches, token-budget micro-batches, GSPO, KL to
a separate reference, truncated IS, lr schedule, gradient checkpointing).
Each update starts 1-2 fresh Python processes (~3-5 s each), so runs are shared through a module cache.
"""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from trainer_helpers import load_weights, make_spec, respec, synthetic_rows, write_advantages

from batchrl.trainer import UpdateSpec, run_update

EXPECTED_METRICS = (
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "perf/num_tokens",
    "perf/update_time_s",
)
LR = 1e-4  # small enough that Adam amplification of float32 summation noise stays far below 1e-5
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def tiny_policy(workdir) -> Path:
    from batchrl_toy import build_toy_model

    out = workdir / "policy_in"
    build_toy_model(out, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=0)
    return out


@pytest.fixture(scope="module")
def vocab_size(tiny_policy) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(tiny_policy)).vocab_size


@pytest.fixture(scope="module")
def advantages_files(workdir, vocab_size) -> list[str]:
    return write_advantages(synthetic_rows(vocab_size=vocab_size), workdir / "advantages")


@pytest.fixture(scope="module")
def perturbed_policy(workdir, tiny_policy) -> Path:
    """tiny_policy with every weight moved by N(0, 0.02): a policy that differs from its reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    out = workdir / "perturbed"
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(tiny_policy)).save_pretrained(str(out))
    return out


# "ppo": the whole table as one mini-batch, fixed-count micro-batches, PPO-clip with dual clip, entropy bonus.
# "full": 2 mini-batches of 2 prompts x 2 epochs, token-budget micro-batches, GSPO, KL to a separate reference,
# truncated IS, warmup + cosine lr, gradient checkpointing.
CONFIGS = {
    "ppo": dict(micro_batch_size=2, ppo_epochs=2, entropy_coeff=0.01, loss_agg_mode="token-mean", dual_clip_ratio=3.0),
    "full": dict(
        ppo_mini_batch_size=2,
        ppo_epochs=2,
        max_tokens_per_micro_batch=40,
        policy_loss="gspo",
        loss_agg_mode="seq-mean-token-mean",
        kl_loss_coef=0.1,
        rollout_is_cap=2.0,
        lr_schedule="cosine",
        lr_warmup_steps=2,
        gradient_checkpointing=True,
    ),
}
# "full" with each prompt computed once per row for several of its samples (update.share_prompt)
CONFIGS["full-shared"] = CONFIGS["full"] | {"share_prompt": True}
_RUNS: dict[tuple, tuple[dict, Path]] = {}


@pytest.fixture(scope="module")
def update(workdir, tiny_policy, perturbed_policy, advantages_files):
    """update(num_processes, config) -> (metrics, policy_out); each configuration runs once."""

    def _update(num_processes: int, config: str) -> tuple[dict, Path]:
        key = (num_processes, config)
        if key not in _RUNS:
            name = f"{config}-{num_processes}proc"
            options = dict(CONFIGS[config])
            if options.get("kl_loss_coef"):
                options["reference_policy"] = str(tiny_policy)
            spec = make_spec(
                policy_in=str(perturbed_policy if config.startswith("full") else tiny_policy),
                policy_out=str(workdir / name / "policy"),
                advantages_files=advantages_files,
                metrics_path=str(workdir / name / "metrics.json"),
                num_processes=num_processes,
                backend="gloo",
                lr=LR,
                **options,
            )
            _RUNS[key] = (run_update(spec, timeout_s=TIMEOUT_S), Path(spec.policy_out))
        return _RUNS[key]

    return _update


def test_update_spec_round_trips_through_json_and_rejects_unknown_choices(tmp_path):
    spec = make_spec(policy_in="in", policy_out="out", advantages_files=["a.parquet"], metrics_path="m.json", lr=3e-6)
    spec.to_json(tmp_path / "spec.json")
    assert UpdateSpec.from_json(tmp_path / "spec.json") == spec
    with pytest.raises(ValueError, match="loss_agg_mode"):
        respec(spec, loss_agg_mode="token-sum")
    with pytest.raises(ValueError, match="advantages_files"):
        respec(spec, advantages_files=[])


def test_one_update_changes_every_weight_and_saves_a_checkpoint_that_reloads(update, tiny_policy, advantages_files):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    metrics, policy_out = update(1, "ppo")

    before, after = load_weights(tiny_policy), load_weights(policy_out)
    assert before.keys() == after.keys()
    unchanged = [name for name in before if (after[name] - before[name]).abs().max() < LR / 2]
    assert unchanged == []  # includes the root's embeddings/norm, not just the per-layer shards
    model = AutoModelForCausalLM.from_pretrained(str(policy_out))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings survive the save
    AutoTokenizer.from_pretrained(str(policy_out))
    assert not list(policy_out.parent.glob(".policy.*"))  # no temporary directories left behind

    assert set(EXPECTED_METRICS) <= set(metrics)
    assert all(math.isfinite(value) for value in metrics.values())
    table = pa.concat_tables(pq.read_table(p) for p in advantages_files)
    assert metrics["perf/num_tokens"] == sum(len(r) for r in table.column("response_token_ids").to_pylist())
    assert metrics["actor/lr"] == LR and metrics["actor/grad_norm"] > 0


@pytest.mark.parametrize("config", ["ppo", "full"])
def test_two_gloo_processes_train_the_same_weights_as_one(update, config):
    metrics_1, policy_1 = update(1, config)
    metrics_2, policy_2 = update(2, config)

    weights_1, weights_2 = load_weights(policy_1), load_weights(policy_2)
    max_abs_diff = max((weights_1[name] - weights_2[name]).abs().max().item() for name in weights_1)
    print(f"{config}: max |w_1proc - w_2proc| = {max_abs_diff:.3g}")
    assert max_abs_diff <= 1e-5
    names = ["actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"]
    if config == "full":
        names += ["actor/kl_loss", "actor/rollout_is_weight_mean"]
    for name in names:
        assert metrics_2[name] == pytest.approx(metrics_1[name], rel=1e-4, abs=1e-6), name


def test_shared_prompt_rows_train_the_same_weights_from_fewer_tokens(update):
    metrics_1, policy_1 = update(1, "full")
    metrics_shared, policy_shared = update(2, "full-shared")  # 2 ranks: packs are dealt to ranks like samples

    weights_1, weights_shared = load_weights(policy_1), load_weights(policy_shared)
    max_abs_diff = max((weights_1[name] - weights_shared[name]).abs().max().item() for name in weights_1)
    print(f"shared prompts: max |w - w_shared| = {max_abs_diff:.3g}")
    assert max_abs_diff <= 1e-5
    for name in ["actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/kl_loss"]:
        assert metrics_shared[name] == pytest.approx(metrics_1[name], rel=1e-4, abs=1e-6), name
    assert metrics_shared["perf/num_tokens"] == metrics_1["perf/num_tokens"]
    assert metrics_shared["perf/real_tokens"] < 0.8 * metrics_1["perf/real_tokens"]  # prompts computed once per pack


def test_each_epoch_takes_one_optimizer_step_per_mini_batch_of_prompts(update):
    metrics, _ = update(1, "full")  # 4 prompts in mini-batches of 2, 2 epochs

    assert metrics["actor/num_optimizer_steps"] == 4 and metrics["actor/global_step"] == 4
    assert metrics["update/staleness_max"] == 3 and metrics["update/staleness_mean"] == 1.5  # steps 0, 1, 2, 3
    assert metrics["actor/kl_loss"] > 0 and metrics["actor/kl_coef"] == 0.1  # the reference differs from the policy
    assert 0 < metrics["actor/rollout_is_weight_mean"] <= 2.0
    # warmup (1/3, 2/3 of lr) then cosine over the remaining 2 steps: the last step is at half of lr
    assert metrics["actor/lr"] == pytest.approx(LR * 0.5)
    assert 1.0 <= metrics["perf/padding_ratio"] <= 1.3


def test_a_nan_advantage_aborts_every_rank_and_writes_no_policy(tmp_path, tiny_policy, vocab_size):
    rows = synthetic_rows(vocab_size=vocab_size, seed=1)
    rows[3]["advantage"] = float("nan")
    spec = make_spec(
        policy_in=str(tiny_policy),
        policy_out=str(tmp_path / "policy"),
        advantages_files=write_advantages(rows, tmp_path / "advantages"),
        metrics_path=str(tmp_path / "metrics.json"),
        num_processes=2,
        backend="gloo",
    )
    with pytest.raises(RuntimeError, match="NaN"):
        run_update(spec, timeout_s=TIMEOUT_S)
    assert not Path(spec.policy_out).exists()
    assert not Path(spec.metrics_path).exists()


def test_a_nan_rollout_logprob_stops_the_update_at_the_loss_before_the_optimizer_step(
    tmp_path, tiny_policy, vocab_size
):
    rows = synthetic_rows(vocab_size=vocab_size, seed=2)
    next(r for r in rows if r["response_token_ids"])["response_logprobs"][0] = float("nan")
    spec = make_spec(
        policy_in=str(tiny_policy),
        policy_out=str(tmp_path / "policy"),
        advantages_files=write_advantages(rows, tmp_path / "advantages"),
        metrics_path=str(tmp_path / "metrics.json"),
        old_logprobs="rollout",
        backend="gloo",
    )
    with pytest.raises(RuntimeError, match="policy loss is nan"):
        run_update(spec, timeout_s=TIMEOUT_S)
    assert not Path(spec.policy_out).exists()


def test_token_ids_outside_the_vocabulary_stop_both_ranks_before_any_step(tmp_path, tiny_policy, vocab_size):
    rows = synthetic_rows(vocab_size=vocab_size, seed=1)
    # in the second part, which the second rank scans: the first rank learns of it from the gathered scans
    next(r for r in rows[len(rows) // 2 :] if r["response_token_ids"])["response_token_ids"][-1] = vocab_size
    spec = make_spec(
        policy_in=str(tiny_policy),
        policy_out=str(tmp_path / "policy"),
        advantages_files=write_advantages(rows, tmp_path / "advantages"),
        metrics_path=str(tmp_path / "metrics.json"),
        num_processes=2,
        backend="gloo",
    )
    with pytest.raises(RuntimeError, match=rf"response_token_ids holds ids in \[\d+, {vocab_size}\] but the policy"):
        run_update(spec, timeout_s=TIMEOUT_S)
    assert not Path(spec.policy_out).exists()
