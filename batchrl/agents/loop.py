"""The agent loop: a shard's conversations, batched per turn on one engine, token in, token out.

Each turn makes ONE ``engine.generate`` call over every conversation still live (vLLM's offline API wants the
whole batch at once): conversation c's prompt is its prompt ids followed by its response so far, with one seed,
derived from the sample's seed and the turn (`turn_seed`; turn 0 uses the sample's own seed, so a sample that calls
no tool equals its single-turn self). Generation stops at ``</tool_call>`` or EOS. The turn's calls, of all
conversations, run in parallel threads with a per-call timeout; their answers are rendered as the chat template's
tool turn (`batchrl.agents.calls.ToolTurnFormat`), tokenised once, and appended as ids with mask 0 and log-prob
0.0. A conversation ends when a turn holds no call (completed), at its token budget (length), when its last allowed
turn still calls (max_turns), on a failed call with ``stop_on_tool_error`` (tool_error), or when its ids so far
fill the engine's context (aborted: only where generate.max_model_len is set below the prompt limit plus the
budget).

Departures worth knowing:
- A turn's generate call asks for the largest allowance of the live conversations and cuts each to its own
  (min(max_new_tokens, budget left)): one call instead of one per distinct allowance. The kept tokens are those a
  call with the smaller cap would have sampled (each sample has its own seeded RNG in both engines), and a cut turn
  ends its conversation with status length.
- A tool that outlives its timeout is answered with an error and left running in its (daemon) thread: Python cannot
  kill a thread. Code that must be stopped belongs in the sandbox (the ``python`` tool), whose process is killed.
Deterministic given the seeds and deterministic tools, which is what resuming a killed shard relies on.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from batchrl.agents.calls import CALL_STOP, ParsedCall, ToolTurnFormat, parse_calls
from batchrl.agents.tools import Tool

STATUSES = ("completed", "length", "max_turns", "tool_error", "aborted", "env_error")  # env_error: environment.py
CHARS_PER_TOKEN = 16  # more characters than a token ever holds: an output cut there still fills the budget


@dataclass(frozen=True)
class LoopSettings:
    """The loop's limits (generate.max_turns, the token budget, tool_timeout_s, max_parallel_tool_calls,
    stop_on_tool_error)."""

    max_turns: int
    max_response_tokens: int
    tool_timeout_s: float = 10.0
    max_parallel_tool_calls: int = 8
    stop_on_tool_error: bool = False
    max_context: int | None = None  # the engine's max_model_len: a conversation that fills it is aborted


@dataclass
class Conversation:
    """One sample's multi-turn response: what the rollouts table stores of it."""

    prompt_token_ids: list[int]
    seed: int
    token_ids: list[int] = field(default_factory=list)  # policy and tool tokens, in order, as fed to the engine
    logprobs: list[float] = field(default_factory=list)  # 0.0 on tool tokens
    mask: list[int] = field(default_factory=list)  # 1 on policy tokens, 0 on tool tokens
    text: str = ""  # the policy's text and the tool turns' text, in order (for reading, never re-tokenised)
    calls: list[dict[str, Any]] = field(default_factory=list)  # name, arguments, output, error, seconds, turn
    turns: int = 0  # policy turns
    status: str | None = None  # one of STATUSES once ended
    finish_reason: str = "stop"  # the last turn's: stop or length
    environment_reward: float | None = None  # the last reward an environment's step gave (batchrl.agents.environment)

    def append(self, token_ids: list[int], logprobs: list[float], *, policy: bool, text: str) -> None:
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.mask += [int(policy)] * len(token_ids)
        self.text += text


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of a sample's turn: its own seed at turn 0, else a 31-bit digest of (seed, turn)."""
    if turn == 0:
        return sample_seed
    digest = hashlib.sha256(f"{sample_seed}/turn/{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def run_conversations(
    engine: Any,
    prompt_token_ids: list[list[int]],
    seeds: list[int],
    *,
    sampling: Any,
    tools: dict[str, Tool],
    settings: LoopSettings,
    tokenizer: Any,
    turn_format: ToolTurnFormat,
    parse: Callable[[str], list[ParsedCall]] = parse_calls,
) -> list[Conversation]:
    """One conversation per (prompt, seed), run turn by turn on ``engine`` (see the module docstring).
    ``tokenizer`` encodes the tool turns (and decodes a cut turn's text); ``parse`` finds a turn's calls."""
    conversations = [Conversation(list(p), s) for p, s in zip(prompt_token_ids, seeds, strict=True)]
    stop = tuple(sampling.stop) + ((CALL_STOP,) if CALL_STOP not in sampling.stop else ())
    for turn in range(settings.max_turns):
        generated = generate_turn(
            engine, conversations, sampling=replace(sampling, stop=stop), settings=settings, turn=turn
        )
        if not generated:
            break
        calling = []
        for index, record, cap in generated:
            conversation = conversations[index]
            calls = _take_turn(conversation, record, cap, tokenizer=tokenizer, parse=parse)
            if calls and turn == settings.max_turns - 1:
                conversation.status = "max_turns"
            elif calls:
                calling.append((conversation, calls))
        _answer_calls(calling, tools=tools, settings=settings, tokenizer=tokenizer, turn_format=turn_format, turn=turn)
    return conversations


def generate_turn(
    engine: Any, conversations: list[Conversation], *, sampling: Any, settings: LoopSettings, turn: int
) -> list[tuple[int, Any, int]]:
    """One turn of every live conversation, in one ``engine.generate`` call: (index, record, allowance) of each
    conversation generated, none when all have ended. A conversation whose ids fill the engine's context ends here
    (aborted: the engine would refuse its prompt); each is prompted with its ids so far and its turn's seed, and
    allowed what its budget and the context leave (`allowance`). The tool loop's and the environments' turn."""
    for c in conversations:
        if c.status is None and settings.max_context and len(c.prompt_token_ids + c.token_ids) >= settings.max_context:
            c.status = "aborted"
    live = [i for i, c in enumerate(conversations) if c.status is None]
    if not live:
        return []
    allowances = [allowance(conversations[i], sampling.max_new_tokens, settings) for i in live]
    groups = engine.generate(
        [conversations[i].prompt_token_ids + conversations[i].token_ids for i in live],
        seeds=[[turn_seed(conversations[i].seed, turn)] for i in live],
        sampling=replace(sampling, max_new_tokens=max(allowances)),
    )
    return [(i, record, cap) for i, (record,), cap in zip(live, groups, allowances, strict=True)]


def allowance(conversation: Conversation, max_new_tokens: int, settings: LoopSettings) -> int:
    """The tokens a conversation's next turn may generate: max_new_tokens, within its budget and the context."""
    tokens = min(max_new_tokens, settings.max_response_tokens - len(conversation.token_ids))
    if settings.max_context:
        tokens = min(tokens, settings.max_context - len(conversation.prompt_token_ids + conversation.token_ids))
    return tokens


def _take_turn(
    conversation: Conversation, record: Any, allowance: int, *, tokenizer: Any, parse: Callable
) -> list[ParsedCall]:
    """Appends the policy's turn to ``conversation`` (cut to ``allowance`` tokens) and returns its calls; ends the
    conversation when the turn calls nothing (completed) or was cut (length)."""
    conversation.turns += 1
    cut = len(record.token_ids) > allowance
    token_ids, logprobs = record.token_ids[:allowance], record.logprobs[:allowance]
    text = tokenizer.decode(token_ids, skip_special_tokens=True) if cut else record.text
    conversation.finish_reason = "length" if cut else record.finish_reason
    calls = parse(text) if conversation.finish_reason == "stop" else []
    if calls and text.count("<tool_call>") > text.count(CALL_STOP):
        text += CALL_STOP  # the engines cut the stop string from their text; its token is in token_ids
    conversation.append(token_ids, logprobs, policy=True, text=text)
    if conversation.finish_reason == "length":
        conversation.status = "length"
    elif not calls:
        conversation.status = "completed"
    return calls


def _answer_calls(
    calling: list[tuple[Conversation, list[ParsedCall]]],
    *,
    tools: dict[str, Tool],
    settings: LoopSettings,
    tokenizer: Any,
    turn_format: ToolTurnFormat,
    turn: int,
) -> None:
    """Runs every call of the turn (all conversations') in parallel and appends each conversation's tool turn."""
    flat = [call for _, calls in calling for call in calls]
    results = run_calls(flat, tools=tools, timeout_s=settings.tool_timeout_s, parallel=settings.max_parallel_tool_calls)
    position = 0
    for conversation, calls in calling:
        records = results[position : position + len(calls)]
        position += len(calls)
        room = settings.max_response_tokens - len(conversation.token_ids)
        for record in records:
            record["turn"] = turn
            # what cannot fit the budget is neither tokenised nor stored (a program may print a megabyte)
            if record["output"] is not None and len(record["output"]) > CHARS_PER_TOKEN * room:
                record["output"] = record["output"][: CHARS_PER_TOKEN * room] + " [cut]"
        conversation.calls += records
        if settings.stop_on_tool_error and any(r["error"] for r in records):
            conversation.status = "tool_error"
            continue
        text = turn_format.render([r["output"] if r["error"] is None else f"error: {r['detail']}" for r in records])
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        conversation.append(token_ids[:room], [0.0] * len(token_ids[:room]), policy=False, text=text)
        if len(token_ids) >= room:  # no room left for the policy's next turn
            conversation.status = "length"


def run_calls(calls: list[ParsedCall], *, tools: dict[str, Tool], timeout_s: float, parallel: int) -> list[dict]:
    """Each call's record (name, arguments, output, error, detail, seconds), in order; at most ``parallel`` run at
    once, each stopped waiting for after ``timeout_s``. ``error`` is None, a malformed call's kind (invalid_json,
    no_name, bad_arguments, unknown_tool) or a failure's (exception, timeout)."""
    records = [_check_call(call, tools) for call in calls]
    runnable = [i for i, record in enumerate(records) if record["error"] is None]
    jobs = [partial(_call_text, tools[calls[i].name].function, calls[i].arguments) for i in runnable]
    for i, outcome in zip(runnable, run_with_timeouts(jobs, timeout_s=timeout_s, parallel=parallel), strict=True):
        value = outcome.pop("value", None)
        records[i] |= outcome | ({"output": value} if outcome["error"] is None else {})
    return records


def _call_text(function: Callable[..., Any], arguments: dict[str, Any]) -> str:
    """A tool's answer as the text the policy reads (JSON for anything but a str)."""
    output = function(**arguments)
    return output if isinstance(output, str) else json.dumps(output, default=str)


def run_with_timeouts(jobs: list[Callable[[], Any]], *, timeout_s: float, parallel: int) -> list[dict[str, Any]]:
    """Each job's outcome, in order: {value, error: None, seconds}, or {error: exception or timeout, detail,
    seconds}. At most ``parallel`` run at once (in chunks, each with one deadline ``timeout_s`` away); a job past
    it is left running in its daemon thread, as Python cannot kill a thread. Tools' calls and environments' reset
    and step calls (batchrl.agents.environment) both run here."""
    outcomes: list[dict[str, Any]] = []
    for start in range(0, len(jobs), parallel):
        threads = [_CallThread(job) for job in jobs[start : start + parallel]]
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            outcomes.append(thread.outcome(timeout_s))
    return outcomes


def _check_call(call: ParsedCall, tools: dict[str, Tool]) -> dict[str, Any]:
    """A call's record before it runs: its error when it is malformed (None when it can run)."""
    record = {"name": call.name, "arguments": call.arguments, "output": None, "error": call.malformed}
    record |= {"detail": call.detail, "seconds": 0.0}
    if call.malformed is None and call.name not in tools:
        record |= {"error": "unknown_tool", "detail": f"no tool {call.name!r}; the tools are {sorted(tools)}"}
    elif call.malformed is None:
        try:
            inspect.signature(tools[call.name].function).bind(**call.arguments)
        except TypeError as error:
            record |= {"error": "bad_arguments", "detail": f"{call.name}: {error}"}
    return record


class _CallThread(threading.Thread):
    """One call; a daemon, so that a call that never returns keeps no process alive."""

    def __init__(self, job: Callable[[], Any]):
        super().__init__(daemon=True)
        self.job = job
        self.result: dict[str, Any] | None = None
        self.started = time.monotonic()

    def run(self) -> None:
        self.started = time.monotonic()
        try:
            self.result = {"value": self.job(), "error": None}
        except Exception as error:  # a tool's or an environment's failure is the sample's, never the stage's
            self.result = {"error": "exception", "detail": f"{type(error).__name__}: {error}"}
        self.result["seconds"] = round(time.monotonic() - self.started, 6)

    def outcome(self, timeout_s: float) -> dict[str, Any]:
        if self.result is None:
            return {"error": "timeout", "detail": f"the call ran past {timeout_s:g} s", "seconds": timeout_s}
        return self.result
