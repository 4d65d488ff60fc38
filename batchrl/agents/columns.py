"""What a shard's conversations add to the rollouts table (the multi-turn columns) and to generate's counts.

Columns (data_schemas/rollouts.json; null in single-turn tables): response_masks (1 policy, 0 tool token),
num_turns, stop_statuses (batchrl.agents.loop.STATUSES) and tool_calls, one JSON string per sample holding the list
of its calls ({"name", "arguments", "output", "error", "detail", "seconds", "turn"}): a JSON string because the
schemas declare scalars and lists only, and a call's arguments have no fixed shape.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from batchrl.agents.calls import ToolTurnFormat
from batchrl.agents.environment import environment_counts, episode_lines, is_episode, load_environment, run_episodes
from batchrl.agents.loop import Conversation, LoopSettings, run_conversations


def conversation_columns(groups: list[list[Conversation]]) -> dict[str, list[Any]]:
    """The response columns of the rollouts table, one list per prompt group, one entry per sample."""

    def column(value: Any) -> list[list[Any]]:
        return [[value(c) for c in group] for group in groups]

    return {
        "response_texts": column(lambda c: c.text),
        "response_token_ids": column(lambda c: c.token_ids),
        "response_logprobs": column(lambda c: c.logprobs),
        "finish_reasons": column(lambda c: c.finish_reason),
        "response_lengths": column(lambda c: len(c.token_ids)),
        "response_masks": column(lambda c: c.mask),
        "num_turns": column(lambda c: c.turns),
        "stop_statuses": column(lambda c: c.status),
        "tool_calls": column(lambda c: json.dumps(c.calls, sort_keys=True, default=str)),
    }


def conversation_counts(conversations: list[Conversation]) -> dict[str, int]:
    """generate's counters of a shard's conversations (summed over shards): samples that called a tool, turns,
    calls, tool tokens, malformed calls and failed calls by kind, and samples by stop status."""
    malformed = {"invalid_json", "no_name", "bad_arguments", "unknown_tool"}
    errors = Counter(call["error"] for c in conversations for call in c.calls if call["error"])
    counts = {
        "tool_samples": sum(1 for c in conversations if c.calls),
        "turns": sum(c.turns for c in conversations),
        "tool_calls": sum(len(c.calls) for c in conversations),
        "tool_tokens": sum(len(c.mask) - sum(c.mask) for c in conversations),
        "malformed_calls": sum(n for kind, n in errors.items() if kind in malformed),
        "tool_errors": sum(n for kind, n in errors.items() if kind not in malformed),
    }
    counts |= {f"tool_errors/{kind}": n for kind, n in sorted(errors.items())}
    counts |= {f"stop/{status}": n for status, n in sorted(Counter(c.status for c in conversations).items())}
    return counts


def tool_stats(counts: dict[str, float]) -> dict[str, float]:
    """generate's tool metrics from its summed counts (empty for a single-turn run): tool-use rate (samples with a
    call), turns per sample, calls per sample, malformed and failed calls per call, and the counts of failed calls
    by kind (tools/tool_errors/<kind>) and of samples by stop status (tools/stop/<status>)."""
    samples = counts.get("num_samples", 0)
    if "turns" not in counts or not samples:
        return {}
    calls = counts.get("tool_calls", 0)
    by_kind = {f"tools/{key}": value for key, value in counts.items() if key.startswith(("tool_errors/", "stop/"))}
    return {
        "tools/use_rate": counts.get("tool_samples", 0) / samples,
        "tools/turns_mean": counts["turns"] / samples,
        "tools/calls_per_sample": calls / samples,
        "tools/malformed_calls": counts.get("malformed_calls", 0),
        "tools/malformed_rate": counts.get("malformed_calls", 0) / calls if calls else 0.0,
        "tools/error_rate": counts.get("tool_errors", 0) / calls if calls else 0.0,
    } | by_kind


def generate_conversations(
    engine: Any,
    prompt_token_ids: list[list[int]],
    seeds: list[list[int]],
    *,
    sampling: Any,
    tools: dict[str, Any],
    settings: LoopSettings,
    tokenizer: Any,
) -> tuple[dict[str, list[Any]], dict[str, int]]:
    """A shard's multi-turn rollouts: every sample of every prompt group is a conversation of one batched loop
    (`run_conversations`); returns the response columns, grouped as the rollouts table holds them, and the counts."""
    flat_prompts = [prompt for prompt, group in zip(prompt_token_ids, seeds, strict=True) for _ in group]
    conversations = run_conversations(
        engine,
        flat_prompts,
        [seed for group in seeds for seed in group],
        sampling=sampling,
        tools=tools,
        settings=settings,
        tokenizer=tokenizer,
        turn_format=ToolTurnFormat.for_chat_template(getattr(tokenizer, "chat_template", None)),
    )
    groups = regroup(conversations, seeds)
    return conversation_columns(groups), conversation_counts(conversations)


def regroup(conversations: list[Conversation], seeds: list[list[int]]) -> list[list[Conversation]]:
    """A shard's conversations (one per sample, in order) back in their prompt groups, as ``seeds`` holds them."""
    groups, start = [], 0
    for group in seeds:
        groups.append(conversations[start : start + len(group)])
        start += len(group)
    return groups


def generate_episodes(
    engine: Any,
    prompt_token_ids: list[list[int]],
    seeds: list[list[int]],
    rows: list[dict[str, Any]],
    *,
    sampling: Any,
    environment: dict[str, Any],
    settings: LoopSettings,
    tokenizer: Any,
) -> tuple[dict[str, list[Any]], dict[str, float]]:
    """A shard's rollouts played against generate.environment ({call, params}): the response columns grouped per
    prompt (the tool loop's, with the steps in tool_calls, and environment_rewards) and generate's counts."""
    cls, params = load_environment(environment["call"]), dict(environment.get("params") or {})
    conversations = run_episodes(
        engine,
        [prompt for prompt, group in zip(prompt_token_ids, seeds, strict=True) for _ in group],
        [seed for group in seeds for seed in group],
        rows,
        sampling=sampling,
        make_env=lambda: cls(**params),
        settings=settings,
        tokenizer=tokenizer,
        turn_format=ToolTurnFormat.for_chat_template(getattr(tokenizer, "chat_template", None)),
    )
    groups = regroup(conversations, seeds)
    columns = conversation_columns(groups)
    columns["environment_rewards"] = [[c.environment_reward for c in group] for group in groups]
    statuses = Counter(c.status for c in conversations)
    counts = environment_counts(conversations) | {f"env_stop/{status}": n for status, n in sorted(statuses.items())}
    return columns, counts


# A tool turn as `ToolTurnFormat` writes it (plain or ChatML), to split a response's text into its turns for reading
_TOOL_TURN = re.compile(
    r"(?:<\|im_end\|>\n<\|im_start\|>user)?(?:\n<tool_response>\n.*?\n</tool_response>)+"
    r"(?:<\|im_end\|>\n<\|im_start\|>assistant\n|\n)",
    re.S,
)


def conversation_lines(text: str, calls_json: str | None, *, status: str | None) -> list[str]:
    """A multi-turn sample for reading (`batchrl inspect`): each policy turn, then each of its tool calls with the
    output or error the policy read, marked ``[tool]``. Split from the stored text by the tool turns' form: a policy
    that writes a <tool_response> itself can shift the split, which only this display would show."""
    calls = json.loads(calls_json) if calls_json else []
    if is_episode(calls):  # played against generate.environment: its steps, not tool calls
        return episode_lines(text, calls, status=status)
    policy_turns = _TOOL_TURN.split(text)
    lines = []
    for turn, policy_text in enumerate(policy_turns):
        lines.append(f"  [turn {turn}] policy: {policy_text!r}")
        for call in (c for c in calls if c.get("turn") == turn):
            answer = call["output"] if call.get("error") is None else f"ERROR {call['error']}: {call.get('detail', '')}"
            lines.append(f"  [tool] {call.get('name')}({json.dumps(call.get('arguments'))}) -> {answer!r}")
    lines.append(f"  [end] {status}")
    return lines
