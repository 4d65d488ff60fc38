"""The trainer's in-process pieces: mini-batch and micro-batch planning, the lr schedule, tensor layout,
gradient checkpointing, and the option checks that must fail before any process starts."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from trainer_helpers import make_spec, synthetic_rows, write_advantages

from batchrl.trainer import UpdateSpec, run_update
from batchrl.trainer.batching import mini_batches, padded_tokens, padding_ratio, plan_micro_batches
from batchrl.trainer.schedule import lr_at_step, resolve_warmup_steps

# ------------------------------------------------------------------------------------ mini-batches


def test_mini_batches_hold_whole_prompt_groups_and_reshuffle_each_epoch():
    group_N = np.repeat(np.arange(10), 4)  # 10 prompts x 4 samples
    epoch_0 = mini_batches(group_N, groups_per_mini_batch=3, seed=7, epoch=0)
    epoch_1 = mini_batches(group_N, groups_per_mini_batch=3, seed=7, epoch=1)

    assert [len(b) for b in epoch_0] == [12, 12, 12, 4]  # 3 + 3 + 3 + 1 prompts
    assert sorted(np.concatenate(epoch_0).tolist()) == list(range(40))
    for batch in epoch_0:
        groups = set(group_N[batch].tolist())
        assert len(batch) == 4 * len(groups)  # no group is split
    assert [b.tolist() for b in epoch_0] == [
        b.tolist() for b in mini_batches(group_N, groups_per_mini_batch=3, seed=7, epoch=0)
    ]
    assert [b.tolist() for b in epoch_0] != [b.tolist() for b in epoch_1]


def test_the_mini_batches_of_a_known_seed_stay_what_they_were_when_pinned():
    """Computed once (`shuffle.keyed_order`): a change moves samples between the optimizer steps of every run."""
    group_N = np.repeat(np.arange(10), 4)
    groups = [
        [sorted(set(group_N[b].tolist())) for b in mini_batches(group_N, groups_per_mini_batch=3, seed=7, epoch=epoch)]
        for epoch in (0, 1)
    ]
    assert groups == [[[1, 2, 4], [0, 5, 6], [3, 7, 9], [8]], [[0, 2, 8], [4, 5, 9], [1, 3, 6], [7]]]


def test_no_mini_batch_size_or_one_covering_every_prompt_gives_one_mini_batch_in_table_order():
    group_N = np.repeat(np.arange(3), 2)
    for size in (None, 3, 100):
        (only,) = mini_batches(group_N, groups_per_mini_batch=size, seed=0, epoch=5)
        assert only.tolist() == list(range(6))


# ----------------------------------------------------------------------------------- micro-batches


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_token_budget_micro_batches_stay_within_budget_and_place_every_sample_once(world_size):
    lengths_N = np.random.default_rng(world_size).integers(5, 300, 97)
    plan = plan_micro_batches(lengths_N, world_size=world_size, max_tokens=1024)

    assert len(plan) == world_size
    assert len({len(micro_batches) for micro_batches in plan}) == 1  # every rank runs the same count
    placed = [i for micro_batches in plan for chunk in micro_batches for i in chunk]
    assert sorted(placed) == list(range(97))
    assert all(padded_tokens(chunk, lengths_N) <= 1024 for micro_batches in plan for chunk in micro_batches)
    loads = [sum(padded_tokens(chunk, lengths_N) for chunk in micro_batches) for micro_batches in plan]
    assert max(loads) - min(loads) <= 1024  # dealt longest-first to the least loaded rank


def test_a_sample_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    plan = plan_micro_batches([60, 8, 300, 9], world_size=1, max_tokens=100)
    assert plan == [[[2], [0], [3, 1]]]  # longest first; 60 + 9 would pad to 120 tokens


def test_one_long_sample_is_not_padded_together_with_many_short_ones():
    lengths_N = [100] + [10] * 9  # filling greedily would pad all ten to 100 tokens (1000 for 190 real)
    assert plan_micro_batches(lengths_N, world_size=1, max_tokens=1000) == [[[0], list(range(1, 10))]]


def test_ranks_with_fewer_micro_batches_get_empty_ones():
    plan = plan_micro_batches([10, 10, 10], world_size=2, max_samples=1)
    assert sorted(len(m) for m in plan) == [2, 2]
    assert sum(chunk == [] for micro_batches in plan for chunk in micro_batches) == 1
    assert plan_micro_batches([], world_size=2, max_samples=4) == [[[]], [[]]]


@pytest.mark.parametrize("limit", [{"max_tokens": 4096}, {"max_samples": 64}])
def test_a_mini_batch_that_fits_one_micro_batch_is_split_so_that_no_rank_idles(limit):
    plan = plan_micro_batches([65, 60, 64, 70, 66, 61], world_size=4, **limit)
    assert [len(micro_batches) for micro_batches in plan] == [1, 1, 1, 1]
    assert sorted(i for micro_batches in plan for chunk in micro_batches for i in chunk) == list(range(6))
    assert plan_micro_batches([65], world_size=2, **limit) in ([[[0]], [[]]], [[[]], [[0]]])  # one sample: one rank


def test_token_budget_packing_keeps_padding_within_ten_percent_on_realistic_lengths():
    """Prompt ~ N(180, 40) tokens, responses log-normal (median ~300, long tail to the 2048 cap): GSM8K-like."""
    rng = np.random.default_rng(0)
    prompts = rng.normal(180, 40, 1024).clip(30, 512)
    responses = np.exp(rng.normal(np.log(300), 0.7, 1024)).clip(1, 2048)
    lengths_N = (prompts + responses).astype(int)
    budget_plan = plan_micro_batches(lengths_N, world_size=2, max_tokens=16384)
    unsorted_plan = [[list(range(r * 512 + k, r * 512 + k + 8)) for k in range(0, 512, 8)] for r in range(2)]

    assert padding_ratio(budget_plan, lengths_N) <= 1.1
    assert padding_ratio(unsorted_plan, lengths_N) > 1.5  # what fixed micro-batches in table order would waste


def test_exactly_one_micro_batch_limit_must_be_given():
    with pytest.raises(ValueError, match="exactly one"):
        plan_micro_batches([1, 2], world_size=1)
    with pytest.raises(ValueError, match="exactly one"):
        plan_micro_batches([1, 2], world_size=1, max_tokens=10, max_samples=2)


# ------------------------------------------------------------------------------ planning from the index


def whole_table_samples(files: list[str]):
    """The plan's input as every rank built it before the index: the whole table, sorted, as Python lists."""
    from batchrl.trainer.data import samples_from_table
    from batchrl.trainer.index import ADVANTAGE_COLUMNS

    table = pa.concat_tables(pq.read_table(path, columns=list(ADVANTAGE_COLUMNS)) for path in files)
    return samples_from_table(table.sort_by([("prompt_id", "ascending"), ("sample_idx", "ascending")]))


@pytest.mark.parametrize("lengths", [True, False], ids=["length-columns", "earlier-table"])
@pytest.mark.parametrize(
    "options",
    [
        dict(micro_batch_size=3),
        dict(max_tokens_per_micro_batch=40, ppo_mini_batch_size=2),
        dict(max_tokens_per_micro_batch=60, ppo_mini_batch_size=3, share_prompt=True),
    ],
    ids=["fixed-count", "token-budget", "shared-prompts"],
)
def test_the_index_of_small_columns_plans_exactly_what_the_whole_table_planned(tmp_path, lengths, options):
    from batchrl.trainer.forward import micro_batch_plan
    from batchrl.trainer.index import read_index

    rows = synthetic_rows(vocab_size=300, num_prompts=7, samples_per_prompt=4, seed=5)
    files = write_advantages(rows, tmp_path, lengths=lengths, row_group_size=5)
    samples, index = whole_table_samples(files), read_index(files)

    assert index.prompt_ids.to_pylist() == samples.prompt_ids
    assert index.sample_idx_N.tolist() == samples.sample_idx
    np.testing.assert_array_equal(index.group_N, samples.group_N)
    np.testing.assert_array_equal(index.lengths_N, samples.lengths_N)
    np.testing.assert_array_equal(index.loss_tokens_N, samples.loss_tokens_N)
    np.testing.assert_array_equal(index.advantages_N, samples.advantages_N)
    spec = make_spec(policy_in="p", policy_out="o", advantages_files=files, metrics_path="m", **options)
    batches = dict(groups_per_mini_batch=spec.update.ppo_mini_batch_size, seed=3)
    for epoch in (0, 1):
        by_table = mini_batches(samples.group_N, epoch=epoch, **batches)
        by_index = mini_batches(index.group_N, epoch=epoch, **batches)
        assert [b.tolist() for b in by_index] == [b.tolist() for b in by_table]
        for indices in by_index:
            for world_size in (1, 2, 3):
                plan = micro_batch_plan(index, indices, spec=spec, world_size=world_size)
                assert plan == micro_batch_plan(samples, indices, spec=spec, world_size=world_size)


def test_the_index_finds_each_sample_at_its_part_and_row(tmp_path):
    from batchrl.trainer.index import read_index

    rows = synthetic_rows(vocab_size=300, num_prompts=3, samples_per_prompt=2, seed=1)
    files = write_advantages(rows, tmp_path)
    index = read_index(files)

    parts = [pq.read_table(path).to_pylist() for path in files]
    for i in range(index.num_samples):
        row = parts[index.part_N[i]][index.row_N[i]]
        assert (row["prompt_id"], row["sample_idx"]) == (index.prompt_ids[i].as_py(), index.sample_idx_N[i])
    positions = np.concatenate([index.rows_of_part(part) for part in range(len(files))])
    assert sorted(positions.tolist()) == list(range(index.num_samples))
    assert index.row_N[index.rows_of_part(1)].tolist() == list(range(len(parts[1])))


def scans_of(files: list[str], *, check_rollout_logprobs: bool = True):
    from batchrl.trainer.index import read_index, scan_part

    index = read_index(files)
    return [scan_part(index, part, check_rollout_logprobs=check_rollout_logprobs) for part in range(len(files))]


def test_streamed_checks_find_ids_outside_the_vocabulary_in_any_part(tmp_path):
    from batchrl.trainer.index import check_lists, check_token_ids

    rows = synthetic_rows(vocab_size=300, num_prompts=4, samples_per_prompt=3, seed=2)
    scans = scans_of(write_advantages(rows, tmp_path / "good", row_group_size=4))
    check_lists(scans)
    check_token_ids(scans, vocab_size=300)
    next(r for r in rows[len(rows) // 2 :] if r["response_token_ids"])["response_token_ids"][0] = 300
    bad = scans_of(write_advantages(rows, tmp_path / "bad", row_group_size=4))
    with pytest.raises(ValueError, match=r"response_token_ids holds ids in \[\d+, 300\] but the policy's vocabulary"):
        check_token_ids(bad, vocab_size=300)
    check_token_ids(bad, vocab_size=301)


def test_streamed_checks_find_engine_logprobs_missing_for_some_response_tokens(tmp_path):
    from batchrl.trainer.index import check_lists

    rows = synthetic_rows(vocab_size=300, num_prompts=4, samples_per_prompt=3, seed=2)
    next(r for r in rows if r["response_token_ids"])["response_logprobs"].pop()
    files = write_advantages(rows, tmp_path, row_group_size=4)
    with pytest.raises(ValueError, match="response_logprobs and response_token_ids differ in length"):
        check_lists(scans_of(files))
    check_lists(scans_of(files, check_rollout_logprobs=False))  # recomputed old log-probs do not read them


def test_a_length_column_that_does_not_count_its_list_is_an_error_naming_the_file(tmp_path):
    from batchrl.trainer.index import check_lists

    files = write_advantages(synthetic_rows(vocab_size=300, seed=2), tmp_path)
    table = pq.read_table(files[1])
    lengths = pc.add(table.column("response_length"), 1).cast(pa.int32())
    pq.write_table(
        table.set_column(table.schema.get_field_index("response_length"), "response_length", lengths), files[1]
    )
    with pytest.raises(ValueError, match=r"part-00001.parquet: \d+ row\(s\) have another number of response_token_ids"):
        check_lists(scans_of(files))


def test_a_part_without_the_advantages_columns_is_named(tmp_path):
    from batchrl.trainer.index import read_index

    files = write_advantages(synthetic_rows(vocab_size=300, seed=2), tmp_path)
    pq.write_table(pq.read_table(files[0]).drop_columns(["advantage"]), files[0])
    with pytest.raises(ValueError, match=r"part-00000.parquet lacks advantages-table columns \['advantage'\]"):
        read_index(files)
    with pytest.raises(ValueError, match="does not exist"):
        read_index([str(tmp_path / "gone.parquet")])


def test_a_rank_reads_the_rows_it_asks_for_from_any_row_group_in_its_order(tmp_path):
    from batchrl.trainer.index import read_index
    from batchrl.trainer.rows import RowReader

    files = write_advantages(
        synthetic_rows(vocab_size=300, num_prompts=5, samples_per_prompt=3, seed=4), tmp_path, row_group_size=2
    )
    samples, index = whole_table_samples(files), read_index(files)
    wanted = np.array([13, 0, 7, 6, 2])  # several parts and row groups, not sorted
    rows = RowReader(index, with_rollout_logprobs=True).read(wanted)

    assert rows.prompt_ids == [samples.prompt_ids[i] for i in wanted]
    assert rows.sample_idx == [samples.sample_idx[i] for i in wanted]
    assert [p.tolist() for p in rows.prompt_token_ids] == [samples.prompt_token_ids[i] for i in wanted]
    assert [r.tolist() for r in rows.response_token_ids] == [samples.response_token_ids[i] for i in wanted]
    np.testing.assert_array_equal(
        rows.flat_rollout_logprobs(), np.concatenate([np.float32(samples.rollout_logprobs[i]) for i in wanted])
    )
    np.testing.assert_array_equal(rows.advantages_N, samples.advantages_N[wanted])
    assert (
        rows.response_offsets_N1.tolist()
        == np.cumsum([0] + [len(samples.response_token_ids[i]) for i in wanted]).tolist()
    )


# ------------------------------------------------------------------------------------- lr schedule


def test_linear_warmup_then_constant_lr_takes_these_values():
    lrs = [lr_at_step(s, lr=1.0, schedule="constant", warmup_steps=3, total_steps=10) for s in range(5)]
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_lr_decays_from_lr_to_the_floor_at_the_last_step():
    lrs = [
        lr_at_step(s, lr=2.0, schedule="cosine", warmup_steps=0, total_steps=4, min_lr_ratio=0.1)
        for s in (0, 1, 2, 4, 9)
    ]
    expected = [2.0, 2 * (0.1 + 0.45 * (1 + math.cos(math.pi / 4))), 2 * 0.55, 0.2, 0.2]
    assert lrs == pytest.approx(expected, rel=1e-12)
    with_warmup = [lr_at_step(s, lr=1.0, schedule="cosine", warmup_steps=2, total_steps=4) for s in range(4)]
    assert with_warmup == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5])


def test_warmup_ratio_counts_a_fraction_of_the_total_steps_unless_steps_are_given():
    assert resolve_warmup_steps(warmup_steps=0, warmup_ratio=0.1, total_steps=45) == 4
    assert resolve_warmup_steps(warmup_steps=7, warmup_ratio=0.0, total_steps=45) == 7


# ------------------------------------------------------------------------------- tensor layout


def _samples(prompts, responses, prompt_ids=None):
    from batchrl.trainer.data import Samples

    offsets = np.concatenate([[0], np.cumsum([len(r) for r in responses])])
    prompt_ids = prompt_ids or [str(k) for k in range(len(prompts))]
    return Samples(
        prompt_ids=prompt_ids,
        sample_idx=[0] * len(prompts),
        prompt_token_ids=prompts,
        response_token_ids=responses,
        rollout_logprobs=[[] for _ in prompts],
        advantages_N=np.arange(1.0, len(prompts) + 1),
        group_N=np.unique(prompt_ids, return_inverse=True)[1],
        response_offsets_N1=offsets,
    )


def test_collate_then_scatter_returns_each_response_token_value_to_its_place():
    from batchrl.trainer.data import collate, scatter_response_values

    samples = _samples([[5, 6], [], [7]], [[8, 9, 10], [11, 12], []])
    flat = np.array([-1, -2, -3, -4, -5], dtype=np.float32)
    mb = collate(samples, [1, 0, 2], pad_token_id=0, device=torch.device("cpu"), token_values={"old": flat})

    assert mb.input_ids_BL.tolist() == [[11, 12, 0, 0, 0], [5, 6, 8, 9, 10], [7, 0, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert mb.position_ids_BL is None and mb.real_tokens == 8 and mb.padded_tokens == 15
    # sample 0 (row 1 of the input, row 1 of [S, R]): prompt [5, 6] predicts 8 at position 1, 9 at 2, 10 at 3
    assert mb.logit_rows_S.tolist() == [0, 1, 2]
    assert mb.logit_positions_SR[1].tolist() == [1, 2, 3]
    assert mb.labels_SR[1].tolist() == [8, 9, 10]
    assert mb.token_values_SR["old"][1].tolist() == [-1, -2, -3]
    assert mb.advantages_SR[1].tolist() == [1.0, 1.0, 1.0]
    # sample 1 (empty prompt): its first response token has no predictor
    assert mb.response_mask_SR[0].tolist() == [False, True, False]
    assert mb.logit_positions_SR[0, 1] == 0  # 12 is predicted by 11
    assert samples.loss_tokens_N.tolist() == [3, 1, 0]
    out = torch.zeros(5)
    scatter_response_values(mb.token_values_SR["old"], mb, samples, out_flat=out)
    assert out.tolist() == [-1, -2, -3, 0, -5]  # the unpredictable token reads 0


def test_a_pack_holds_the_prompt_once_and_each_response_sees_the_prompt_and_itself_at_its_unpacked_positions():
    from batchrl.trainer.data import collate_packs, scatter_response_values

    samples = _samples([[5, 6], [5, 6], [7]], [[8, 9], [10], [11]], prompt_ids=["a", "a", "b"])
    flat = np.array([-1, -2, -3, -4], dtype=np.float32)
    mb = collate_packs(samples, [[0, 1], [2]], pad_token_id=0, device=torch.device("cpu"), token_values={"old": flat})

    assert mb.input_ids_BL.tolist() == [[5, 6, 8, 9, 10], [7, 11, 0, 0, 0]]
    assert mb.position_ids_BL.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    assert mb.real_tokens == 7
    allowed = mb.attention_mask[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # response 0 sees the prompt and itself
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],
    ]  # response 1 sees the prompt, not response 0
    assert mb.attention_mask[1, 0].int().tolist()[:2] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert all(row.any() for row in mb.attention_mask[1, 0])  # padding queries see something: no NaN rows
    # both responses' first tokens are predicted by the prompt's last position
    assert mb.logit_rows_S.tolist() == [0, 0, 1]
    assert mb.logit_positions_SR.tolist() == [[1, 2], [1, 0], [0, 0]]
    assert mb.response_mask_SR.tolist() == [[True, True], [True, False], [True, False]]
    assert mb.labels_SR.tolist() == [[8, 9], [10, 0], [11, 0]]
    out = torch.zeros(4)
    scatter_response_values(mb.token_values_SR["old"], mb, samples, out_flat=out)
    assert out.tolist() == [-1, -2, -3, -4]


def test_prompt_packs_group_equal_prompts_within_the_token_budget_and_leave_empty_prompts_alone():
    from batchrl.trainer.batching import prompt_packs

    key, prompt, response = [0, 0, 0, 1, 0, 2], [4, 4, 4, 3, 4, 0], [2, 3, 5, 1, 1, 2]
    packs = prompt_packs(
        range(6), prompt_key_N=key, prompt_lengths_N=prompt, response_lengths_N=response, max_tokens=10
    )
    # 4 + 2 + 3 = 9 fits, + 5 does not: a new pack for sample 2, which then takes sample 4 (4 + 5 + 1 = 10)
    assert packs == [[0, 1], [2, 4], [3], [5]]
    assert prompt_packs(
        [4, 0], prompt_key_N=key, prompt_lengths_N=prompt, response_lengths_N=response, max_tokens=100
    ) == [[4, 0]]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_rows_give_the_unpacked_log_probs_entropies_and_gradients(tmp_path, attention):
    from batchrl.trainer.data import collate, collate_packs
    from batchrl.trainer.forward import policy_logprobs
    from batchrl.trainer.fsdp import load_model
    from batchrl_toy import build_toy_model

    build_toy_model(
        tmp_path / "m",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_layers=2,
    )
    model = load_model(str(tmp_path / "m")).eval()
    model.set_attn_implementation(attention)
    assert model.config._attn_implementation == attention
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompt_a, prompt_b = rng.integers(3, vocab, 9).tolist(), rng.integers(3, vocab, 4).tolist()
    responses = [rng.integers(3, vocab, n).tolist() for n in (5, 1, 7, 3, 6)]
    samples = _samples([prompt_a] * 3 + [prompt_b] * 2, responses, prompt_ids=["a"] * 3 + ["b"] * 2)
    cpu = torch.device("cpu")

    def forward_backward(mb):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = policy_logprobs(model, mb, entropy_grad=True)
        mask = mb.response_mask_SR
        ((logprobs * mb.advantages_SR)[mask].sum() + entropy[mask].sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        order = np.argsort(mb.indices)
        return logprobs[order].detach(), entropy[order].detach(), mask[order], grads

    plain = forward_backward(collate(samples, range(5), pad_token_id=0, device=cpu))
    packed_mb = collate_packs(samples, [[0, 1, 2], [3, 4]], pad_token_id=0, device=cpu)
    assert packed_mb.real_tokens == 9 + 13 + 4 + 9  # each prompt counted once
    packed = forward_backward(packed_mb)
    assert torch.equal(plain[2], packed[2])
    torch.testing.assert_close(packed[0][packed[2]], plain[0][plain[2]], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[1][packed[2]], plain[1][plain[2]], atol=1e-5, rtol=0)
    for name, grad in plain[3].items():
        torch.testing.assert_close(packed[3][name], grad, atol=1e-5, rtol=1e-4, msg=name)


# ------------------------------------------------------------------------- gradient checkpointing


def test_gradient_checkpointing_recomputes_each_decoder_layer_in_backward_and_keeps_dropout_off(tmp_path):
    from batchrl.trainer.fsdp import load_model, set_dropout_free_mode
    from batchrl_toy import build_toy_model

    build_toy_model(
        tmp_path / "m", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=0
    )
    input_ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = {}
    for checkpointing in (False, True):
        model = load_model(str(tmp_path / "m"), gradient_checkpointing=checkpointing)
        assert set_dropout_free_mode(model) == (2 if checkpointing else 0)
        calls = []
        for layer in model.model.layers:
            assert not layer.self_attn.training  # attention dropout stays off
            layer.self_attn.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        model(input_ids=input_ids).logits.float().logsumexp(-1).sum().backward()
        assert len(calls) == (4 if checkpointing else 2)  # each layer's attention ran again in backward
        grads[checkpointing] = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------- option checks


def _spec(**options) -> UpdateSpec:
    options = {"metrics_path": "m.json", **options}
    return make_spec(policy_in="in", policy_out="out", advantages_files=["a.parquet"], **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on machines without CUDA")
def test_cpu_offload_is_rejected_on_cpu_before_any_process_starts(tmp_path):
    from batchrl.config.models import UpdateConfig

    with pytest.raises(ValueError, match="cpu_offload"):
        _spec(cpu_offload=True, backend="gloo")
    with pytest.raises(ValueError, match="cpu_offload.*needs CUDA"):
        run_update(_spec(cpu_offload=True, metrics_path=str(tmp_path / "m.json")), timeout_s=10)
    with pytest.raises(ValueError, match="cpu_offload"):
        UpdateConfig(cpu_offload=True, backend="gloo")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(rollout_is_cap=2.0, old_logprobs="rollout"), "rollout_is_cap"),
        (dict(dual_clip_ratio=3.0, policy_loss="gspo"), "dual_clip_ratio"),
        (dict(lr_warmup_steps=3, lr_warmup_ratio=0.1), "warmup"),
    ],
)
def test_contradictory_update_options_are_rejected_by_config_and_spec(options, message):
    from pydantic import ValidationError

    from batchrl.config.models import UpdateConfig

    with pytest.raises(ValidationError, match=message):
        UpdateConfig(**options)
    with pytest.raises(ValueError, match=message):
        _spec(**options)


def test_kl_loss_needs_a_reference_and_sum_norm_needs_a_length():
    with pytest.raises(ValueError, match="reference_policy"):
        _spec(kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="loss_agg_norm_length"):
        _spec(loss_agg_mode="seq-mean-token-sum-norm")


def test_the_spec_checks_its_own_fields():
    with pytest.raises(ValueError, match="dtype"):
        _spec(dtype="float16")
    with pytest.raises(ValueError, match="num_iterations"):
        _spec(num_iterations=0)


@pytest.mark.parametrize(
    "option, value",
    [
        ("num_processes", 0),
        ("micro_batch_size", 0),
        ("ppo_epochs", 0),
        ("max_tokens_per_micro_batch", 0),
        ("ppo_mini_batch_size", 0),
        ("lr_total_steps", 0),
        ("loss_agg_norm_length", 0),
        ("lr", -1e-6),
        ("weight_decay", -0.1),
        ("clip_ratio_low", -0.1),
        ("clip_ratio_high", -0.1),
        ("entropy_coeff", -0.1),
        ("kl_loss_coef", -0.1),
        ("lr_warmup_steps", -1),
        ("lr_warmup_ratio", -0.1),
        ("lr_warmup_ratio", 1.5),
        ("min_lr_ratio", -0.1),
        ("min_lr_ratio", 1.5),
        ("rollout_is_cap", 0.5),
        ("dual_clip_ratio", 1.0),
        ("lr_schedule", "linear"),
        ("kl_estimator", "k4"),
        ("policy_loss", "grpo"),
        ("old_logprobs", "engine"),
        ("backend", "mpi"),
    ],
)
def test_the_bounds_an_update_spec_once_checked_itself_are_the_configs(option, value):
    """UpdateSpec re-checked these until it carried the config (issue 12); each is now UpdateConfig's alone."""
    from pydantic import ValidationError

    from batchrl.config.models import UpdateConfig

    with pytest.raises(ValidationError, match=option):
        UpdateConfig(**{option: value})
    with pytest.raises(ValueError, match=option):
        _spec(**{option: value})


def test_the_config_offers_exactly_the_algorithms_kl_estimators_and_aggregation_modes():
    from typing import get_args

    from batchrl.algorithms.kl import KL_ESTIMATORS
    from batchrl.algorithms.losses import AGGREGATION_MODES
    from batchrl.config.models import UpdateConfig

    assert get_args(UpdateConfig.model_fields["kl_estimator"].annotation) == KL_ESTIMATORS
    assert get_args(UpdateConfig.model_fields["loss_agg_mode"].annotation) == AGGREGATION_MODES


def test_rank_threads_follow_the_cpu_affinity_and_the_cgroup_quota_not_the_hosts_core_count(monkeypatch, tmp_path):
    from pathlib import Path

    from batchrl.trainer import launch

    cgroup_cpu_quota = launch._cgroup_cpu_quota
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(launch, "_cgroup_cpu_quota", lambda: None)
    assert launch.usable_cpus() == 8
    monkeypatch.setattr(launch, "_cgroup_cpu_quota", lambda: 3)
    assert launch.usable_cpus() == 3
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch._worker_env(rank=0, world_size=2, port=1)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert launch._worker_env(rank=0, world_size=2, port=1)["OMP_NUM_THREADS"] == "4"

    real_path = Path
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(launch, "Path", lambda p: cpu_max if p == "/sys/fs/cgroup/cpu.max" else real_path(p))
    cpu_max.write_text("250000 100000\n")
    assert cgroup_cpu_quota() == 3
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpu_quota() is None
