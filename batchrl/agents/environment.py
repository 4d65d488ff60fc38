"""Environments (generate.environment): the policy's turns played against a user's class, which answers each turn
with an observation and can give the sample a reward.

An environment is a class named ``package.module:Class`` and built with ``Class(**generate.environment.params)``,
one instance per sample. Its contract (no base class to inherit: any class with these two methods):

- ``reset(row) -> str | None``: the sample begins. ``row`` is the prompt row (prompt_id, data_source, prompt_text,
  messages, ground_truth, extra_info) with the sample's ``sample_idx`` and ``sample_seed``; an environment that
  draws anything at random seeds its RNG from ``sample_seed``, so that a regenerated shard equals the lost one.
  A returned text is a first observation, appended after the prompt before the policy's first turn.
- ``step(action) -> Step | (observation, reward, done)``: after each policy turn, with the turn's text. An
  observation (a str) is appended as the next turn's context unless ``done``; None ends the sample. A reward (a
  number) is remembered: the sample's environment reward is the LAST one given (an environment that wants a
  total keeps its own sum), null when none was.

The loop (`run_episodes`) is the tool loop's (`batchrl.agents.loop`) with the environment in the tools' place: one
``engine.generate`` per turn over every live sample, per-turn seeds (`turn_seed`), policy tokens with mask 1,
observations rendered as the template's tool turn (`ToolTurnFormat.render_observation`), tokenised once and
appended with mask 0, never re-tokenised. Generation stops at EOS or generate.stop only (no call tag). Every
policy turn is stepped, the last one too (at max_turns or cut at the budget), so the environment can reward it;
its observation is then not appended. Status: completed (done, or no observation), length, max_turns, aborted,
or env_error: reset or step raised, returned something else than the contract says, or ran past
generate.tool_timeout_s (error "timeout"), a counted error of that sample (its reward null), never a failed stage.

The samples' resets (each class built in its reset's thread), then each turn's steps, run in parallel threads, at
most generate.max_parallel_tool_calls at once, each with generate.tool_timeout_s as its deadline, as tools' calls
do (`batchrl.agents.loop.run_with_timeouts`): a slow environment costs a turn its slowest call, not the sum of
them, and a hung one ends its own sample instead of hanging the shard until generate.shard_timeout_s. A call past
its deadline is left running in its daemon thread (Python cannot kill a thread); its instance is never called
again. Each sample has its own instance, so the results do not depend on the threads' order; what instances share
(module state, the global ``random``) must be thread-safe, or not shared.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from batchrl.agents.calls import ToolTurnFormat
from batchrl.agents.loop import CHARS_PER_TOKEN, Conversation, LoopSettings, generate_turn, run_with_timeouts
from batchrl.errors import ConfigError, type_phrase
from batchrl.references import import_reference


@dataclass(frozen=True)
class Step:
    """What an environment's step answers: the next observation (None: the sample ends), a reward, and done."""

    observation: str | None = None
    reward: float | None = None
    done: bool = False


def as_step(value: Any) -> Step:
    """A step's return value as a Step; ValueError saying what it is instead."""
    if isinstance(value, Step):
        step = value
    elif isinstance(value, tuple) and len(value) == 3:
        step = Step(*value)
    else:
        raise ValueError(f"step returned {type_phrase(value)}, not a Step or (observation, reward, done)")
    if step.observation is not None and not isinstance(step.observation, str):
        raise ValueError(f"step's observation is {type_phrase(step.observation)}, not a str or None")
    reward = step.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, numbers.Real)):  # numpy's too
        raise ValueError(f"step's reward is {type_phrase(reward)}, not a number or None")
    if reward is not None and not math.isfinite(reward):
        raise ValueError(f"step's reward is {reward}, not a finite number")
    return replace(step, reward=None if reward is None else float(reward), done=bool(step.done))


def load_environment(call: str) -> type:
    """The class generate.environment.call names; ValueError saying why it is not an environment."""
    cls = import_reference(call, what="environment")
    if not inspect.isclass(cls):
        raise ValueError(f"is {type_phrase(cls)}, not a class")
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise ValueError(f"has no {' and no '.join(missing)} method: an environment has reset(row) and step(action)")
    return cls


def check_environment(environment: Any, *, source: str | None = None) -> None:
    """ConfigError (exit 2) naming generate.environment.call when it is not an environment (imports its module)."""
    if environment is None:
        return
    try:
        load_environment(environment.call)
    except ValueError as error:
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}generate.environment.call={environment.call!r}: {error}") from None


ENVIRONMENT_ROW_COLUMNS = [
    "prompt_id",
    "data_source",
    "prompt_text",
    "messages_json",
    "ground_truth",
    "extra_info_json",
]


def environment_rows(columns: dict[str, list[Any]], seeds: list[list[int]]) -> list[dict[str, Any]]:
    """What each sample's reset(row) is given, one per sample in shard order, from the prompts' columns."""
    rows = []
    for r, group in enumerate(seeds):
        extra, messages = columns["extra_info_json"][r], columns["messages_json"][r]
        row = {
            "prompt_id": columns["prompt_id"][r],
            "data_source": columns["data_source"][r],
            "prompt_text": columns["prompt_text"][r],
            "messages": json.loads(messages) if messages else None,
            "ground_truth": columns["ground_truth"][r],
            "extra_info": json.loads(extra) if extra else None,
        }
        rows += [row | {"sample_idx": i, "sample_seed": seed} for i, seed in enumerate(group)]
    return rows


@dataclass
class _Episode:
    """A conversation and its environment instance (None once it failed)."""

    conversation: Conversation
    env: Any


def run_episodes(
    engine: Any,
    prompt_token_ids: list[list[int]],
    seeds: list[int],
    rows: list[dict[str, Any]],
    *,
    sampling: Any,
    make_env: Callable[[], Any],
    settings: LoopSettings,
    tokenizer: Any,
    turn_format: ToolTurnFormat,
) -> list[Conversation]:
    """One conversation per (prompt, seed, row), played against its own ``make_env()`` (module docstring)."""
    episodes = [_Episode(Conversation(list(p), s), None) for p, s in zip(prompt_token_ids, seeds, strict=True)]
    resets = [partial(_reset, make_env, row, episode) for episode, row in zip(episodes, rows, strict=True)]
    for episode, observation in zip(episodes, _run(episodes, "reset", resets, settings, turn=-1), strict=True):
        if episode.conversation.status is None and observation is not None:
            _observe(episode.conversation, observation, settings, tokenizer, turn_format)
    conversations = [e.conversation for e in episodes]
    for turn in range(settings.max_turns):
        generated = generate_turn(engine, conversations, sampling=sampling, settings=settings, turn=turn)
        if not generated:
            break
        live = [episodes[index] for index, _, _ in generated]
        actions = [_take_turn(e.conversation, record, cap, tokenizer) for e, (_, record, cap) in zip(live, generated)]
        steps = _run(
            live,
            "step",
            [partial(_step, e.env, text) for e, (text, _) in zip(live, actions, strict=True)],
            settings,
            turn=turn,
        )
        for episode, (_, cut), step in zip(live, actions, steps, strict=True):
            _answer(
                episode.conversation,
                step,
                cut,
                turn=turn,
                settings=settings,
                tokenizer=tokenizer,
                turn_format=turn_format,
            )
    return conversations


def _reset(make_env: Callable[[], Any], row: dict[str, Any], episode: _Episode) -> Any:
    episode.env = make_env()
    observation = episode.env.reset(dict(row))
    if observation is not None and not isinstance(observation, str):
        raise ValueError(f"reset returned {type_phrase(observation)}, not a str or None")
    return observation


def _step(env: Any, action: str) -> Step:
    return as_step(env.step(action))


def _take_turn(c: Conversation, record: Any, cap: int, tokenizer: Any) -> tuple[str, bool]:
    """Appends the policy's turn (cut to ``cap`` tokens); (its text, whether it was cut)."""
    c.turns += 1
    cut = len(record.token_ids) > cap
    text = tokenizer.decode(record.token_ids[:cap], skip_special_tokens=True) if cut else record.text
    c.finish_reason = "length" if cut else record.finish_reason
    c.append(record.token_ids[:cap], record.logprobs[:cap], policy=True, text=text)
    return text, cut


def _answer(
    c: Conversation,
    step: Step | None,
    cut: bool,
    *,
    turn: int,
    settings: LoopSettings,
    tokenizer: Any,
    turn_format: Any,
) -> None:
    """Keeps a turn's step's reward, and appends its observation or ends the sample."""
    if c.status is not None:  # the step failed
        return
    if step.reward is not None:
        c.environment_reward = step.reward
    if cut:
        c.status = "length"
    elif step.done or step.observation is None:
        c.status = "completed"
    elif len(c.token_ids) >= settings.max_response_tokens:  # no room for the observation
        c.status = "length"
    elif turn == settings.max_turns - 1:
        c.status = "max_turns"
    else:
        _observe(c, step.observation, settings, tokenizer, turn_format)


def _run(
    episodes: list[_Episode], name: str, jobs: list[Callable[[], Any]], settings: LoopSettings, *, turn: int
) -> list[Any]:
    """Runs a turn's reset or step calls in parallel threads, as tools' calls (`run_with_timeouts`), recording each
    in its conversation's calls ({name, output, reward, done, error, detail, seconds, turn}); a call that raised,
    broke the contract or ran past generate.tool_timeout_s ends its sample with status env_error and no reward.
    The results in order (None for a failed call)."""
    outcomes = run_with_timeouts(jobs, timeout_s=settings.tool_timeout_s, parallel=settings.max_parallel_tool_calls)
    results = []
    for episode, outcome in zip(episodes, outcomes, strict=True):
        c, result = episode.conversation, outcome.get("value")
        record: dict[str, Any] = {"name": name, "arguments": {}, "output": None, "error": None, "detail": ""}
        record["turn"] = turn
        if outcome["error"] is not None:  # the environment's failure is the sample's, never the stage's
            record |= {"error": outcome["error"], "detail": outcome["detail"]}
            c.status, c.environment_reward = "env_error", None
        elif isinstance(result, Step):
            record |= {"output": result.observation, "reward": result.reward, "done": result.done}
        else:
            record["output"] = result
        c.calls.append(record | {"seconds": outcome["seconds"]})
        results.append(result)
    return results


def _observe(c: Conversation, observation: str, settings: LoopSettings, tokenizer: Any, turn_format: Any) -> None:
    """Appends an observation as the template's tool turn (mask 0), cut to the sample's budget."""
    room = settings.max_response_tokens - len(c.token_ids)
    if len(observation) > CHARS_PER_TOKEN * room:  # a megabyte of observation is neither tokenised nor stored
        observation = observation[: CHARS_PER_TOKEN * room] + " [cut]"
    text = turn_format.render_observation(observation)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    c.append(token_ids[:room], [0.0] * len(token_ids[:room]), policy=False, text=text)
    if len(token_ids) >= room:
        c.status = "length"


def environment_counts(conversations: list[Conversation]) -> dict[str, float]:
    """generate's counters of an environment's samples (summed over shards): rewarded samples and their rewards'
    sum, failed samples, policy turns, observation tokens."""
    rewards = [c.environment_reward for c in conversations if c.environment_reward is not None]
    return {
        "env_rewarded": len(rewards),
        "env_reward_sum": sum(rewards),
        "env_errors": sum(1 for c in conversations if c.status == "env_error"),
        "env_turns": sum(c.turns for c in conversations),
        "env_observation_tokens": sum(len(c.mask) - sum(c.mask) for c in conversations),
    }


def environment_stats(counts: dict[str, float]) -> dict[str, float]:
    """generate's environment metrics (empty without an environment): the mean reward of the rewarded samples,
    the share of samples rewarded and of samples whose environment failed, turns per sample, samples by status."""
    samples = counts.get("num_samples", 0)
    if "env_rewarded" not in counts or not samples:
        return {}
    rewarded = counts["env_rewarded"]
    by_status = {f"environment/stop/{k[len('env_stop/') :]}": v for k, v in counts.items() if k.startswith("env_stop/")}
    return {
        "environment/reward_mean": counts["env_reward_sum"] / rewarded if rewarded else 0.0,
        "environment/rewarded_rate": rewarded / samples,
        "environment/error_rate": counts.get("env_errors", 0) / samples,
        "environment/turns_mean": counts.get("env_turns", 0) / samples,
    } | by_status


def is_episode(calls: list[dict[str, Any]]) -> bool:
    """Whether a sample's tool_calls records are an environment's (its reset, turn -1, comes first)."""
    return bool(calls) and calls[0].get("name") == "reset" and calls[0].get("turn") == -1


def episode_lines(text: str, calls: list[dict[str, Any]], *, status: str | None) -> list[str]:
    """A sample played against an environment, for reading (`batchrl inspect`): its text (the policy's turns and
    the observations, in order), then reset and each step with the observation, reward and done, marked [env]."""
    lines = [f"  [text] {text!r}"]
    for call in calls:
        if call.get("error"):
            answer = f"ERROR {call['error']}: {call.get('detail', '')}"
        else:
            reward = "" if call.get("reward") is None else f", reward {call['reward']:g}"
            answer = f"{call.get('output')!r}{reward}" + (", done" if call.get("done") else "")
        lines.append(f"  [env] {call['name']} (turn {call['turn']}) -> {answer}")
    return [*lines, f"  [end] {status}"]
