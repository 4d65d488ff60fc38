"""The toy SFT warm start: a random model never answers in the reward's format; a few dozen SFT steps make it
answer "#### n" on held-out questions. And the held-out split really is held out: no training prompt and no
SFT demonstration is a held-out question."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest
from transformers import AutoTokenizer

from batchrl.engines import SamplingSpec, make_engine
from batchrl.rewards.gsm8k import extract_gsm8k_answer, gsm8k_strict
from batchrl_toy import (
    all_arith_problems,
    arith_problems,
    build_toy_model,
    ensure_toy_assets,
    is_held_out,
    sft_warm_start,
)


def greedy_answers(model_dir: str, questions: list[str]) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for q in questions
    ]
    engine = make_engine("hf", model_path=model_dir, dtype="float32")
    groups = engine.generate(
        prompts, seeds=[[0]] * len(prompts), sampling=SamplingSpec(temperature=0.0, max_new_tokens=6)
    )
    engine.close()
    return [group[0].text for group in groups]


def test_a_short_sft_teaches_the_answer_format_on_held_out_questions(tmp_path):
    model_dir = str(tmp_path / "model")
    build_toy_model(model_dir, seed=5)
    held_out = arith_problems(num_prompts=12, seed=3, split="eval", max_operand=9)
    questions = [q for q, _ in held_out]
    before = greedy_answers(model_dir, questions)
    assert not any(extract_gsm8k_answer(text, method="strict") for text in before)

    stats = sft_warm_start(model_dir, num_steps=40, batch_size=16, lr=3e-3, max_operand=9, seed=5)
    after = greedy_answers(model_dir, questions)
    answered = [extract_gsm8k_answer(text, method="strict") is not None for text in after]
    assert sum(answered) >= 10, after
    assert all(text.startswith("#### ") for text, ok in zip(after, answered) if ok)
    assert stats["sft/loss_last"] < stats["sft/loss_first"] / 2
    assert all(gsm8k_strict(text, truth) in (0.0, 1.0) for text, (_, truth) in zip(after, held_out))


def test_held_out_questions_never_appear_in_training_prompts_or_sft_demonstrations(tmp_path):
    held_out = {q for q, _ in all_arith_problems(max_operand=20) if is_held_out(q)}
    assert 40 < len(held_out) < 90  # ~10% of the 672 problems
    train = arith_problems(num_prompts=2000, seed=1, split="train", max_operand=20)  # what sft_warm_start draws
    assert not {q for q, _ in train} & held_out
    evaluation = arith_problems(num_prompts=50, seed=0, split="eval", max_operand=20)
    assert len({q for q, _ in evaluation}) == 50 and {q for q, _ in evaluation} <= held_out
    with pytest.raises(ValueError, match="only .* held-out problems"):
        arith_problems(num_prompts=len(held_out) + 1, seed=0, split="eval", max_operand=20)


def test_toy_assets_with_an_eval_dir_keep_training_and_held_out_prompts_apart(tmp_path):
    ensure_toy_assets(
        tmp_path / "m",
        tmp_path / "train",
        num_prompts=40,
        num_shards=2,
        max_operand=20,
        eval_dir=tmp_path / "eval",
        num_eval_prompts=30,
    )
    train = ds.dataset(tmp_path / "train", format="parquet").to_table().to_pylist()
    evaluation = ds.dataset(tmp_path / "eval", format="parquet").to_table().to_pylist()
    assert len(train) == 40 and len(evaluation) == 30
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evaluation}
    assert all(r["prompt_id"].startswith("arith-eval-") for r in evaluation)
    assert json.loads((tmp_path / "eval" / "_TOY_PROMPTS.json").read_text())["split"] == "eval"
    assert json.loads((tmp_path / "m" / "_TOY_MODEL.json").read_text())["sft_steps"] == 0


def test_an_ungraded_demonstration_is_the_right_number_that_the_strict_reward_rejects():
    from batchrl_toy import arith_demonstration

    assert gsm8k_strict(arith_demonstration("17"), "17") == 1.0
    assert arith_demonstration("17", graded_format=False) == "#### 17."
    assert gsm8k_strict(arith_demonstration("17", graded_format=False), "17") == 0.0
