"""The agent loop on a real engine (the toy model, hf; vLLM where installed): token in, token out. The toy model is
random, so a scripted call format stands in for Hermes: a turn that stops on a space calls a deterministic tool with
the turn's text. Each sample's response ids must be exactly the engine's outputs and the appended tool ids, in order;
the mask must mark exactly the tool spans; every continuation must be prompted with the ids so far (never
re-tokenised text); and the same seeds must give the same conversations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchrl.agents.calls import ParsedCall, ToolTurnFormat
from batchrl.agents.loop import LoopSettings, run_conversations, turn_seed
from batchrl.agents.tools import Tool, json_schema
from batchrl.engines import SamplingSpec, make_engine, vllm_available

ENGINES = [
    "hf",
    pytest.param(
        "vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM not installed")]
    ),
]
SEEDS = [11, 12, 13, 14, 15, 16]
SAMPLING = SamplingSpec(temperature=1.0, max_new_tokens=12, stop=(" ",))


def count(text: str) -> str:
    """Counts the characters of a text.

    Args:
        text: What to count.
    """
    return f"{len(text)} chars"


TOOLS = {"count": Tool("count", count, json_schema(count))}
PLAIN = ToolTurnFormat.for_chat_template(None)


def scripted_calls(text: str) -> list[ParsedCall]:
    """Every turn that stopped on its stop string calls count with its text."""
    return [ParsedCall("count", {"text": text})]


class Recording:
    """The engine, with every generate call's prompts and records kept (it still does all the work)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompt_token_ids, *, seeds, sampling):
        records = self.engine.generate(prompt_token_ids, seeds=seeds, sampling=sampling)
        self.calls.append((prompt_token_ids, seeds, records))
        return records


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, toy_model_dir):
    engine = make_engine(request.param, model_path=toy_model_dir, max_model_len=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer(toy_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    questions = ["What is 12 * 34?", "What is 7 + 5? Answer with #### and the number."]
    ids = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions
    ]
    ids = [i["input_ids"] if isinstance(i, dict) or hasattr(i, "keys") else i for i in ids]
    return [ids[k % 2] for k in range(len(SEEDS))]


BUDGET = 100  # the plain tool turn of a short answer is ~30 toy tokens


def converse(engine, tokenizer, prompts, *, budget=BUDGET, max_turns=3):
    recording = Recording(engine)
    conversations = run_conversations(
        recording,
        prompts,
        SEEDS,
        sampling=SAMPLING,
        tools=TOOLS,
        settings=LoopSettings(max_turns=max_turns, max_response_tokens=budget),
        tokenizer=tokenizer,
        turn_format=PLAIN,
        parse=scripted_calls,
    )
    return conversations, recording.calls


def without_seconds(conversations):
    return [
        (c.token_ids, c.logprobs, c.mask, c.text, c.turns, c.status, [call | {"seconds": 0} for call in c.calls])
        for c in conversations
    ]


def test_responses_are_the_engine_outputs_and_the_tool_ids_exactly_and_the_mask_marks_the_tool_spans(
    engine, tokenizer, prompts
):
    conversations, calls = converse(engine, tokenizer, prompts)
    assert len(calls) >= 2, "the scripted tool made no second turn: the test would prove nothing"
    assert any(c.turns >= 2 for c in conversations) and any(c.calls for c in conversations)
    for index, conversation in enumerate(conversations):
        expected_ids, expected_mask, expected_logprobs = [], [], []
        for turn, (turn_prompts, turn_seeds, records) in enumerate(calls):
            row = [k for k, seeds in enumerate(turn_seeds) if seeds == [turn_seed(SEEDS[index], turn)]]
            if not row:
                break
            # the continuation is prompted with the ids so far, never with re-tokenised text
            assert turn_prompts[row[0]] == prompts[index] + expected_ids
            record = records[row[0]][0]
            kept = record.token_ids[: BUDGET - len(expected_ids)]
            expected_ids += kept
            expected_mask += [1] * len(kept)
            expected_logprobs += record.logprobs[: len(kept)]
            if turn < len(conversation.calls):
                answer = PLAIN.render([conversation.calls[turn]["output"]])
                tool_ids = tokenizer.encode(answer, add_special_tokens=False)[: BUDGET - len(expected_ids)]
                expected_ids += tool_ids
                expected_mask += [0] * len(tool_ids)
                expected_logprobs += [0.0] * len(tool_ids)
        assert conversation.token_ids == expected_ids
        assert conversation.mask == expected_mask
        assert conversation.logprobs == expected_logprobs
        assert len(conversation.token_ids) <= BUDGET


def test_the_same_seeds_give_the_same_conversations(engine, tokenizer, prompts):
    first, _ = converse(engine, tokenizer, prompts)
    again, _ = converse(engine, tokenizer, prompts)
    assert without_seconds(again) == without_seconds(first)


def test_conversations_end_by_status_within_the_turn_and_token_limits(engine, tokenizer, prompts):
    conversations, _ = converse(engine, tokenizer, prompts, budget=60, max_turns=2)
    for c in conversations:
        assert c.turns <= 2 and len(c.token_ids) <= 60
        assert c.status in ("completed", "length", "max_turns")
        assert (c.status == "max_turns") == (c.turns == 2 and c.finish_reason == "stop" and len(c.calls) == 1)
        assert all(
            call["turn"] == 0 and call["output"] == f"{len(call['arguments']['text'])} chars" for call in c.calls
        )
    assert {c.status for c in conversations} >= {"length"}


def test_qwens_tool_turn_encodes_its_turn_markers_as_the_special_tokens_the_template_uses(tokenizer):
    qwen = ToolTurnFormat.for_chat_template("<|im_start|> <tool_response>")
    ids = tokenizer.encode(qwen.render(["42"]), add_special_tokens=False)
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids[0] == im_end and ids.count(im_start) == 2 and ids.count(im_end) == 2
    assert tokenizer.decode(ids) == qwen.render(["42"])


def shout(text: str) -> str:
    """Answers with a megabyte.

    Args:
        text: Ignored.
    """
    return "x" * 1_000_000


def test_an_output_beyond_the_budget_is_cut_before_it_is_tokenised_and_ends_the_sample_at_its_length(
    engine, tokenizer, prompts
):
    conversations = run_conversations(
        engine,
        prompts,
        SEEDS,
        sampling=SAMPLING,
        tools={"shout": Tool("shout", shout, json_schema(shout))},
        settings=LoopSettings(max_turns=3, max_response_tokens=BUDGET),
        tokenizer=tokenizer,
        turn_format=PLAIN,
        parse=lambda text: [ParsedCall("shout", {"text": text})],
    )
    called = [c for c in conversations if c.calls]
    assert called, "no turn stopped on its stop string: the test would prove nothing"
    for c in called:
        assert c.status == "length" and len(c.token_ids) == BUDGET and c.mask[-1] == 0
        assert len(c.calls[0]["output"]) <= 16 * BUDGET + len(" [cut]")


def test_a_conversation_that_fills_the_engines_context_is_aborted_not_sent(engine, tokenizer, prompts):
    context = max(len(p) for p in prompts) + 16
    conversations = run_conversations(
        engine,
        prompts,
        SEEDS,
        sampling=SAMPLING,
        tools=TOOLS,
        settings=LoopSettings(max_turns=3, max_response_tokens=BUDGET, max_context=context),
        tokenizer=tokenizer,
        turn_format=PLAIN,
        parse=scripted_calls,
    )
    called = [c for c in conversations if c.calls]
    assert called, "no turn stopped on its stop string: the test would prove nothing"
    assert all(c.status == "aborted" and c.turns == 1 for c in called)  # the tool turn filled the context
    assert all(len(c.prompt_token_ids) + c.mask.count(1) <= context for c in conversations)


def test_sampling_without_logprobs_gives_the_same_samples_and_vllm_skips_the_logprobs(engine, prompts):
    """What a judge asks for (it reads verdicts as text): the same tokens and text for the same seeds."""
    seeds = [[seed] for seed in SEEDS[: len(prompts)]]
    with_logprobs = engine.generate(prompts, seeds=seeds, sampling=SAMPLING)
    without = engine.generate(prompts, seeds=seeds, sampling=replace(SAMPLING, logprobs=False))
    for (a,), (b,) in zip(with_logprobs, without, strict=True):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        assert len(a.logprobs) == len(a.token_ids)
        assert b.logprobs == ([] if engine.name.startswith("vllm") else a.logprobs)
