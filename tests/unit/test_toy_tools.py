"""The tool toy (task multiply_tools, pipelines/tools_quickstart.yaml): its SFT demonstrations are conversations the
agent loop would have written. The call parses as batchrl.agents parses a policy's turn, the tool turn's ids are
exactly those the loop appends for the calculator's answer (and out of the loss), the call is a few tokens of the
toy tokenizer, and the held-out questions are never trained on."""

from __future__ import annotations

import pytest

from batchrl.agents.calls import ToolTurnFormat, parse_calls
from batchrl.agents.loop import Conversation, LoopSettings, _answer_calls
from batchrl.agents.tools import load_tools
from batchrl_toy.sft import _sft_batch, _tool_response
from batchrl_toy.task import all_arith_problems, arith_problems, is_held_out
from batchrl_toy.tokenizer import build_toy_tokenizer

QUESTION, ANSWER = "What is 37 * 8? Answer with #### followed by the number.", "296"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_toy_tokenizer(tmp_path_factory.mktemp("tools-tokenizer"), task="multiply_tools", vocab_size=512)


def test_a_calculator_demonstration_is_the_conversation_the_agent_loop_writes(tokenizer):
    ids, labels = _tool_response(tokenizer, QUESTION, ANSWER)
    policy = [i for i, label in zip(ids, labels) if label != -100]
    tool_start = next(k for k, label in enumerate(labels) if label == -100)
    tool_end = len(labels) - labels[::-1].index(-100)
    call_text = tokenizer.decode(ids[:tool_start])
    [call] = parse_calls(call_text)
    assert (call.name, call.arguments) == ("calculator", {"expression": "37*8"})
    assert len(ids[:tool_start]) <= 25, "the call's merges are missing: the model would have ~70 bytes to write"

    conversation = Conversation(prompt_token_ids=[], seed=0)  # what the loop appends after that turn
    settings = LoopSettings(max_turns=2, max_response_tokens=64)
    turn_format = ToolTurnFormat.for_chat_template(tokenizer.chat_template)
    tools = load_tools(["calculator"])
    _answer_calls(
        [(conversation, [call])], tools=tools, settings=settings, tokenizer=tokenizer, turn_format=turn_format, turn=0
    )
    assert ids[tool_start:tool_end] == conversation.token_ids and conversation.mask == [0] * len(conversation.token_ids)
    assert tokenizer.decode(ids[tool_end:]) == f"#### {ANSWER}<|im_end|>"
    assert policy == ids[:tool_start] + ids[tool_end:]  # the tool's tokens are out of the loss


def test_the_warm_start_mixes_calls_and_direct_answers_as_asked(tokenizer):
    problems = [(QUESTION, ANSWER)] * 2
    _, _, labels_BT = _sft_batch(tokenizer, problems, [True, True], [True, False])
    trained = [[i for i in row.tolist() if i != -100] for row in labels_BT]
    ids, labels = _tool_response(tokenizer, QUESTION, ANSWER)
    assert trained[0] == [i for i in labels if i != -100]  # the call and the answer, not the tool turn
    assert tokenizer.decode(trained[1]) == f"#### {ANSWER}<|im_end|>"  # a direct answer


def test_the_products_split_into_training_and_held_out_questions():
    every = all_arith_problems(max_operand=99, task="multiply_tools")
    assert len(every) == 90 * 18 and all(int(a) == eval(q[8:].split("?")[0]) for q, a in every)
    train = arith_problems(num_prompts=200, seed=0, max_operand=99, split="train", task="multiply_tools")
    held_out = arith_problems(num_prompts=60, seed=0, max_operand=99, split="eval", task="multiply_tools")
    assert not any(is_held_out(q) for q, _ in train) and all(is_held_out(q) for q, _ in held_out)
    assert len({q for q, _ in held_out}) == 60
