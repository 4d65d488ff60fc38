"""Consecutive updates as one training run (optimizer state carried over), the KL loss against a hand
computation, the recorded log-probs, bfloat16 mixed precision, and the stage's optimizer-state housekeeping.

The carry-over runs use the engine's log-probs as the old policy (old_logprobs="rollout"), so an update of
one epoch started from the previous update's policy and optimizer state must take exactly the step that
the second epoch of a single two-epoch update takes.
"""

from __future__ import annotations

import math
import pickle
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from trainer_helpers import load_weights, make_spec, respec, synthetic_rows, write_advantages

from batchrl.trainer import UpdateSpec, run_update
from batchrl.trainer.integrity import TrainerStateError, file_sha256

LR = 1e-3  # large enough that a step without Adam's carried moments lands visibly elsewhere
TIMEOUT_S = 120
COMMON = dict(
    backend="gloo", lr=LR, old_logprobs="rollout", kl_loss_coef=0.5, lr_warmup_steps=2, max_tokens_per_micro_batch=64
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainer_resume")


@pytest.fixture(scope="module")
def tiny_policy(workdir) -> Path:
    from batchrl_toy import build_toy_model

    out = workdir / "policy_in"
    build_toy_model(out, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=0)
    return out


@pytest.fixture(scope="module")
def advantages_files(workdir, tiny_policy) -> list[str]:
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(str(tiny_policy)).vocab_size
    return write_advantages(synthetic_rows(vocab_size=vocab_size, seed=3), workdir / "advantages")


_RUNS: dict[str, tuple[dict, UpdateSpec]] = {}


@pytest.fixture(scope="module")
def runs(workdir, tiny_policy, advantages_files):
    """first: 1 epoch on 2 processes, saving its optimizer state; second: 1 epoch from first's policy and
    state; fresh: the same without the state; both_epochs: 2 epochs in one update. Reference: tiny_policy."""

    def spec(name: str, **options) -> UpdateSpec:
        options = {"policy_in": str(tiny_policy), "reference_policy": str(tiny_policy), **COMMON, **options}
        return make_spec(
            policy_out=str(workdir / name / "policy"),
            advantages_files=advantages_files,
            metrics_path=str(workdir / name / "metrics.json"),
            logprobs_dir=str(workdir / name / "logprobs"),
            **options,
        )

    def _run(name: str) -> tuple[dict, UpdateSpec]:
        if name not in _RUNS:
            first = workdir / "first"
            specs = {
                "first": lambda: spec("first", num_processes=2, trainer_state_out=str(first / "state")),
                "second": lambda: spec(
                    "second",
                    policy_in=str(_run("first")[1].policy_out),
                    trainer_state_in=str(first / "state"),
                    trainer_state_sha256=recorded_digests(first / "state"),
                ),
                "fresh": lambda: spec("fresh", policy_in=str(_run("first")[1].policy_out)),
                "both_epochs": lambda: spec("both_epochs", ppo_epochs=2),
            }
            update_spec = specs[name]()
            _RUNS[name] = (run_update(update_spec, timeout_s=TIMEOUT_S), update_spec)
        return _RUNS[name]

    return _run


def recorded_digests(state_dir: Path) -> dict[str, str]:
    """What the stage records of a saved trainer state: sha256 by path under it."""
    return {p.relative_to(state_dir).as_posix(): file_sha256(p) for p in state_dir.rglob("*") if p.is_file()}


class CreatesAFileWhenUnpickled:
    """A planted pickle: unpickling it runs Path.touch, where an attacker's would run anything."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def max_weight_diff(a: Path, b: Path) -> float:
    weights_a, weights_b = load_weights(a), load_weights(b)
    return max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)


def test_two_updates_carrying_the_optimizer_state_equal_one_update_of_two_epochs(runs):
    second_metrics, second = runs("second")
    both_metrics, both = runs("both_epochs")
    fresh_metrics, fresh = runs("fresh")

    diff = max_weight_diff(Path(second.policy_out), Path(both.policy_out))
    print(f"carried-over vs one run: max |w diff| = {diff:.3g}")
    assert diff <= 1e-6
    assert second_metrics["actor/optimizer_state_restored"] == 1 and second_metrics["actor/global_step"] == 2
    assert second_metrics["actor/lr"] == pytest.approx(LR * 2 / 3)  # warmup continued at step 1, not restarted
    assert fresh_metrics["actor/lr"] == pytest.approx(LR / 3)
    assert max_weight_diff(Path(fresh.policy_out), Path(both.policy_out)) > 1e-4  # the state is what matters
    assert sorted(p.name for p in Path(runs("first")[1].trainer_state_out).rglob("*")) == sorted(
        ["optimizer", ".metadata", "__0_0.distcp", "__1_0.distcp", "trainer_state.json"]
    )


@pytest.mark.parametrize("resident", [False, True])
def test_a_trainer_state_file_that_does_not_hash_as_recorded_is_refused_before_it_is_unpickled(
    runs, tmp_path, resident
):
    from batchrl.trainer import shutdown_trainers

    _, first = runs("first")
    state = tmp_path / "state"
    shutil.copytree(first.trainer_state_out, state)
    recorded = recorded_digests(state)
    marker = tmp_path / "code-ran"
    planted = pickle.dumps(CreatesAFileWhenUnpickled(marker))
    pickle.loads(planted)  # the planted file does run code when unpickled...
    assert marker.exists()
    marker.unlink()
    (state / "optimizer" / ".metadata").write_bytes(planted)
    spec = respec(
        first,
        policy_in=first.policy_out,
        num_processes=1,
        trainer_state_in=str(state),
        trainer_state_sha256=recorded,
        trainer_state_out=None,
        policy_out=str(tmp_path / "policy"),
        metrics_path=str(tmp_path / "metrics.json"),
        logprobs_dir=str(tmp_path / "logprobs"),
    )
    try:
        with pytest.raises(TrainerStateError, match=r"optimizer/\.metadata: sha256 .* is not the .* recorded"):
            run_update(spec, timeout_s=TIMEOUT_S, resident=resident)
    finally:
        shutdown_trainers()
    assert not marker.exists()  # ...but the rank refused it before loading
    assert not Path(spec.policy_out).exists()


def test_the_kl_loss_is_zero_at_the_first_step_when_the_reference_is_the_policy(runs):
    metrics, spec = runs("first")
    assert metrics["actor/kl_loss"] == 0.0 and metrics["actor/kl_coef"] == 0.5
    # each of the 2 ranks wrote the samples it computed: together, every sample once
    assert sorted(p.name for p in Path(spec.logprobs_dir).iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    logprobs = pq.read_table(spec.logprobs_dir).to_pylist()
    keys = sorted((r["prompt_id"], r["sample_idx"]) for r in logprobs)
    table = pq.read_table(spec.advantages_files)
    assert keys == sorted(zip(table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist()))
    assert all(pq.read_metadata(p).num_rows > 0 for p in Path(spec.logprobs_dir).iterdir())
    assert all(row["ref_logprob_sum"] < 0 for row in logprobs if row["num_loss_tokens"])


def policy_token_logprobs(policy_dir: str, row: dict) -> list[float]:
    """log p(response token | prefix) under the policy, straight from transformers (float64 log-softmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    ids = row["prompt_token_ids"] + row["response_token_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logprobs = torch.log_softmax(logits, -1)
    start = len(row["prompt_token_ids"])
    return [float(logprobs[t - 1, ids[t]]) for t in range(start, len(ids))]


def test_the_kl_loss_and_the_recorded_logprobs_match_a_hand_computation(runs, tiny_policy, advantages_files):
    metrics, spec = runs("second")  # policy = first's output, reference = tiny_policy: they differ
    rows = [r for path in advantages_files for r in pq.read_table(path).to_pylist()]
    recorded = {(r["prompt_id"], r["sample_idx"]): r for r in pq.read_table(spec.logprobs_dir).to_pylist()}
    kl_values = []
    for row in rows:
        if not row["response_token_ids"]:
            continue
        ref = policy_token_logprobs(str(tiny_policy), row)
        policy = policy_token_logprobs(spec.policy_in, row)
        kl_values += [math.exp(r - p) - (r - p) - 1 for p, r in zip(policy, ref)]  # k3 = low_var_kl here
        record = recorded[(row["prompt_id"], row["sample_idx"])]
        np.testing.assert_allclose(record["ref_logprobs"], ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(record["old_logprobs"], row["response_logprobs"], rtol=1e-6)  # old = rollout
        assert record["ref_logprob_sum"] == pytest.approx(sum(ref), rel=1e-5)

    assert metrics["actor/kl_loss"] == pytest.approx(sum(kl_values) / len(kl_values), rel=1e-4)  # token-mean


def test_a_bfloat16_mixed_precision_update_trains_and_saves_float32_weights(workdir, tiny_policy, advantages_files):
    from safetensors import safe_open

    spec = make_spec(
        policy_in=str(tiny_policy),
        policy_out=str(workdir / "bf16" / "policy"),
        advantages_files=advantages_files,
        metrics_path=str(workdir / "bf16" / "metrics.json"),
        backend="gloo",
        dtype="bfloat16",
        lr=LR,
        ppo_mini_batch_size=2,
        max_tokens_per_micro_batch=64,
    )
    metrics = run_update(spec, timeout_s=TIMEOUT_S)

    assert all(math.isfinite(v) for v in metrics.values()) and metrics["actor/num_optimizer_steps"] == 2
    assert max_weight_diff(tiny_policy, Path(spec.policy_out)) > LR / 2
    with safe_open(f"{spec.policy_out}/model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}


# ------------------------------------------------------------------------------ stage housekeeping


def stage_context(tmp_path: Path, *, iteration: int, keep: int | None, **update):
    from batchrl.config.models import PipelineConfig
    from batchrl.pipeline.stage import StageContext
    from batchrl.storage import RunLayout

    cfg = PipelineConfig(
        name="t",
        run={"root": str(tmp_path), "iterations": 5},
        model={"path": "m"},
        data={"train_files": ["x.parquet"]},
        update={"keep_last_k_optimizer_states": keep, **update},
    )
    layout = RunLayout.for_run(str(tmp_path), "t")
    return StageContext(
        cfg=cfg,
        layout=layout,
        iteration=iteration,
        output_dir=layout.table_dir("policy", iteration),
        fingerprint="f",
        inputs={},
        input_dirs={},
        policy_in=layout.table_dir("policy", iteration - 1),
    )


def store(ctx):
    from batchrl.trainer.state_store import TrainerStateStore

    return TrainerStateStore(ctx.cfg, ctx.layout)


def recorded_state(ctx):
    """The optimizer state the update of ``ctx`` continues, as the update reads it."""
    return store(ctx).recorded(iteration=ctx.iteration, policy_in=ctx.policy_in)


def committed_policy(policy_dir: Path, *, state: bool | None = True) -> None:
    """A policy as its update commits it: weights, and (state=True) an optimizer state whose files its manifest
    records with their sha256; state=False: the update saved none; None: a manifest of an older batchrl (no record)."""
    from batchrl.storage.manifest import Manifest, PartInfo, write_manifest

    files = {"model.safetensors": b"weights"}
    if state is not False:
        files |= {
            "_trainer_state/trainer_state.json": b'{"global_step": 1}',
            "_trainer_state/optimizer/.metadata": b"metadata",
            "_trainer_state/optimizer/__0_0.distcp": b"x",
        }
    for name, data in files.items():
        (policy_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (policy_dir / name).write_bytes(data)
    listed = [PartInfo(name, 0, file_sha256(policy_dir / name), len(data)) for name, data in files.items()]
    write_manifest(
        str(policy_dir),
        Manifest(
            stage="update",
            table="policy",
            iteration=0,
            fingerprint="f",
            parts=listed[:1],
            schema="",
            started_at=0.0,
            finished_at=1.0,
            trainer_state=None if state is None else listed[1:],
        ),
    )


@pytest.mark.parametrize("keep, kept", [(1, [2]), (2, [1, 2]), (None, [0, 1, 2])])
def test_an_update_deletes_optimizer_states_older_than_the_last_k_but_never_policies(tmp_path, keep, kept):
    ctx = stage_context(tmp_path, iteration=3, keep=keep)
    for iteration in range(3):
        committed_policy(Path(ctx.layout.table_dir("policy", iteration)))

    store(ctx).prune(ctx.iteration)

    states = [i for i in range(3) if Path(ctx.layout.table_dir("policy", i), "_trainer_state").exists()]
    assert states == kept  # the state this update resumes from (iteration 2) always survives
    assert all(Path(ctx.layout.table_dir("policy", i), "model.safetensors").exists() for i in range(3))
    state = recorded_state(ctx)
    assert state.uri == str(Path(ctx.policy_in) / "_trainer_state")
    assert state.sha256 == recorded_digests(Path(state.uri))
    assert recorded_state(stage_context(tmp_path, iteration=0, keep=keep)) is None


def test_an_update_whose_optimizer_state_is_gone_stops_with_the_iteration_to_redo_the_updates_from(tmp_path):
    from batchrl.errors import DataError

    ctx = stage_context(tmp_path, iteration=3, keep=1)
    for iteration in range(3):
        committed_policy(Path(ctx.layout.table_dir("policy", iteration)))
    shutil.rmtree(Path(ctx.layout.table_dir("policy", 0), "_trainer_state"))  # as keep-last-1 pruning leaves it
    (Path(ctx.policy_in) / "_trainer_state" / "optimizer" / "__0_0.distcp").unlink()
    with pytest.raises(
        DataError,
        match=r"iter_0002/policy/_trainer_state/optimizer/__0_0.distcp is gone.*"
        r"--from-stage update --iteration 2 ",
    ):
        recorded_state(ctx)  # iteration 1's state is intact: updates 2 and 3 can be redone from it
    shutil.rmtree(Path(ctx.layout.table_dir("policy", 1), "_trainer_state"))
    with pytest.raises(DataError, match=r"--from-stage update --iteration 0 "):
        recorded_state(ctx)  # none left: iteration 0's update is the first that needs none


def test_an_update_restarts_adam_only_after_an_update_that_saved_no_state(tmp_path):
    ctx = stage_context(tmp_path, iteration=1, keep=1)
    committed_policy(Path(ctx.policy_in), state=False)  # iteration 0 had nothing to train on
    assert recorded_state(ctx) is None


def test_an_optimizer_state_recorded_without_checksums_is_refused_unless_unverified_states_are_allowed(
    tmp_path, caplog
):
    from batchrl.errors import DataError
    from batchrl.stages.update import UpdateStage

    for iteration in range(2):
        committed_policy(Path(stage_context(tmp_path, iteration=iteration, keep=None).output_dir), state=None)
    ctx = stage_context(tmp_path, iteration=2, keep=None)  # continues iteration 1's state, of an earlier batchrl
    with pytest.raises(
        DataError,
        match=r"iter_0001/policy/_trainer_state, whose policy manifest records no sha256 .* set "
        r"update.allow_unverified_trainer_state: true .* --from-stage update --iteration 0$",
    ):
        UpdateStage().check_ready(ctx)  # iteration 0's state has no checksums either: only update 0 needs none

    allowed = stage_context(tmp_path, iteration=2, keep=None, allow_unverified_trainer_state=True)
    state = recorded_state(allowed)
    store(allowed).log_recorded(state, iteration=allowed.iteration, policy_in=allowed.policy_in)
    assert state.sha256 is None and "loaded unverified" in caplog.text
    fingerprint = UpdateStage().fingerprint_config
    assert fingerprint(allowed.cfg) == fingerprint(ctx.cfg)  # allowing it redoes nothing


def test_extending_a_run_keeps_update_fingerprints_unless_the_lr_schedule_spans_the_run():
    from batchrl.config.models import PipelineConfig
    from batchrl.stages.update import UpdateStage

    def fingerprint(iterations: int, **update) -> dict:
        cfg = PipelineConfig(
            name="t",
            run={"iterations": iterations},
            model={"path": "m"},
            data={"train_files": ["x.parquet"]},
            update=update,
        )
        return UpdateStage().fingerprint_config(cfg)

    assert fingerprint(2) == fingerprint(4)
    assert fingerprint(2, lr_schedule="cosine", lr_total_steps=100) == fingerprint(
        4, lr_schedule="cosine", lr_total_steps=100
    )
    assert fingerprint(2, lr_schedule="cosine") != fingerprint(4, lr_schedule="cosine")
    assert fingerprint(2, keep_last_k_optimizer_states=1) == fingerprint(2, keep_last_k_optimizer_states=3)
    assert fingerprint(2, keep_last_k_optimizer_states=1) != fingerprint(2, keep_last_k_optimizer_states=0)


def test_update_fingerprints_are_those_of_earlier_batchrl_versions():
    """Completed update stages of existing runs stay valid: the digests were computed before the UpdateSpec was
    rebuilt from the config (issue 12), for a default and a many-option update."""
    from batchrl.config.models import PipelineConfig
    from batchrl.stages.update import UpdateStage
    from batchrl.storage.manifest import fingerprint

    def digest(**update) -> str:
        cfg = PipelineConfig(
            name="t",
            run={"iterations": 3, "seed": 7},
            model={"path": "m"},
            data={"train_files": ["x.parquet"]},
            update=update,
        )
        return fingerprint(dict(UpdateStage().fingerprint_config(cfg), iteration=1))

    assert digest() == "83d2e725bdd353b8fe2b"
    assert (
        digest(
            policy_loss="gspo",
            clip_ratio_low=3e-4,
            clip_ratio_high=4e-4,
            loss_agg_mode="seq-mean-token-sum-norm",
            kl_loss_coef=0.1,
            lr_schedule="cosine",
            lr_warmup_ratio=0.1,
            ppo_mini_batch_size=2,
            max_tokens_per_micro_batch=512,
            share_prompt=True,
            keep_last_k_optimizer_states=0,
        )
        == "2dcc005a0322465e0aaf"
    )


def test_the_stage_hands_the_ranks_its_validated_update_config_with_the_norm_length_resolved(tmp_path):
    from batchrl.stages.update import _spec

    ctx = stage_context(tmp_path, iteration=2, keep=1)
    ctx.cfg.update = {
        "policy_loss": "gspo",
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "kl_loss_coef": 0.1,
        "keep_last_k_optimizer_states": 1,
    }
    spec = _spec(
        ctx,
        policy_in="in",
        reference_policy="m",
        advantages_files=["a.parquet"],
        trainer_state_in=None,
        trainer_state_sha256=None,
        policy_out="out",
        out_dir=str(tmp_path),
        metrics_path="m.json",
    )

    resolved = {"loss_agg_norm_length"}
    assert spec.update.model_dump(exclude=resolved) == ctx.cfg.update.model_dump(exclude=resolved)
    assert ctx.cfg.update.loss_agg_norm_length is None
    assert spec.update.loss_agg_norm_length == ctx.cfg.generate.max_new_tokens
    assert (spec.seed, spec.num_iterations, spec.reference_policy) == (ctx.cfg.run.seed + 2, 1, "m")
    spec.to_json(tmp_path / "spec.json")
    # gspo with the default update.dual_clip_ratio: the rank re-validates what the user set, not the defaults
    assert UpdateSpec.from_json(tmp_path / "spec.json") == spec
