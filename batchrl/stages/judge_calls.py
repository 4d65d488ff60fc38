"""The judge stage's work on one shard: render each sample's judge prompt, call the judge, parse, retry.

`JudgeCalls` holds the judge a worker built once: an engine of judge.model with its tokenizer, or an HTTP client of
judge.endpoint; both answer a list of conversations with one text each. `judge_group_columns` makes the judgements
columns of a shard from it. Retries: the samples whose text held no valid verdict are asked again, all together (one
batched engine call per attempt), each with the seed of its next attempt, so a redone shard makes the same calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from batchrl.config.judge import JudgeConfig
from batchrl.rewards.judge import parse_verdict, render_judge_prompt
from batchrl.stages.generate import sample_seed

TOO_LONG = "too_long"  # the error kind of a judge prompt that does not fit the judge's context


@dataclass
class Verdict:
    """One sample's judgement as it builds up over the attempts."""

    score: float | None = None
    text: str = ""
    attempts: int = 0
    error: str | None = None
    prompt_tokens: int = 0
    tokens: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)


class JudgeCalls:
    """The judge of one worker; ``ask`` answers conversations with (text, prompt tokens, generated tokens, error)."""

    def __init__(self, judge: JudgeConfig, *, run_seed: int, iteration: int):
        self.judge, self.run_seed, self.iteration = judge, run_seed, iteration
        self.engine = self.tokenizer = self.client = None
        if judge.endpoint is not None:
            from batchrl.engines.chat_http import ChatClient

            self.client = ChatClient(**judge.endpoint.model_dump())
        else:
            from transformers import AutoTokenizer

            from batchrl.engines import make_engine, vllm_available
            from batchrl.storage import local_copy

            local = local_copy(judge.model)
            self.tokenizer = AutoTokenizer.from_pretrained(local, trust_remote_code=judge.trust_remote_code)
            self.context_tokens = judge.max_model_len or context_length(local, judge.trust_remote_code)
            vllm = judge.engine == "vllm" or (judge.engine == "auto" and vllm_available())
            self.engine = make_engine(
                judge.engine,
                model_path=local,
                dtype=judge.dtype,
                max_model_len=judge.max_model_len,
                engine_kwargs=vllm_kwargs(judge) if vllm else None,
            )

    def seed(self, prompt_id: str, sample_idx: int, attempt: int) -> int:
        """The seed of a judge call: another one for each attempt, the same for the same call in a redone shard."""
        return sample_seed(self.run_seed, self.iteration, f"judge/{attempt}/{prompt_id}", sample_idx)

    def messages(self, fields: dict[str, Any]) -> list[dict[str, str]]:
        """The conversation the judge answers (ValueError: the template names a field the sample lacks)."""
        system = [{"role": "system", "content": self.judge.system_prompt}] if self.judge.system_prompt else []
        return [*system, {"role": "user", "content": render_judge_prompt(self.judge.template, fields)}]

    def ask(
        self, conversations: list[list[dict[str, str]]], seeds: list[int], *, temperature: float
    ) -> list[tuple[str, int, int, str | None]]:
        j = self.judge
        if self.client is not None:
            sampling = {"temperature": temperature, "top_p": j.top_p, "max_tokens": j.max_new_tokens}
            results = self.client.complete(conversations, seeds=seeds, sampling=sampling)
            return [(r.text, 0, r.completion_tokens, r.error and f"request: {r.error}") for r in results]
        from batchrl.engines import SamplingSpec
        from batchrl.stages.ingest_rows import encode, render_texts

        texts = render_texts(conversations, self.tokenizer, apply_template=j.apply_chat_template)
        prompts = encode(texts, self.tokenizer, add_special_tokens=not j.apply_chat_template)
        # A prompt that leaves no room for a verdict is not sent: an engine would fail the whole batch on it
        fits = [k for k, p in enumerate(prompts) if len(p) < self.context_tokens]
        # a verdict is read as text: no per-token log-probs (the engine skips them, H2 measured their cost)
        sampling = SamplingSpec(temperature=temperature, top_p=j.top_p, max_new_tokens=j.max_new_tokens, logprobs=False)
        groups = self.engine.generate([prompts[k] for k in fits], seeds=[[seeds[k]] for k in fits], sampling=sampling)
        answers = [
            ("", len(p), 0, f"{TOO_LONG}: {len(p)} tokens, the judge's context {self.context_tokens}") for p in prompts
        ]
        for k, group in zip(fits, groups):
            answers[k] = (group[0].text, len(prompts[k]), len(group[0].token_ids), None)
        return answers

    def judge_all(self, verdicts: list[Verdict], keys: list[tuple[str, int]]) -> None:
        """Asks the judge for every verdict that has messages, retrying the unparsable ones; fills them in place."""
        pending = [i for i, v in enumerate(verdicts) if v.messages]
        for attempt in range(self.judge.max_retries + 1):
            if not pending:
                break
            seeds = [self.seed(*keys[i], attempt) for i in pending]
            temperature = self.judge.retry_temperature if attempt else self.judge.temperature
            answers = self.ask([verdicts[i].messages for i in pending], seeds, temperature=temperature)
            retry = []
            for i, (text, prompt_tokens, tokens, error) in zip(pending, answers):
                v = verdicts[i]
                called = error is None or not error.startswith(TOO_LONG)
                v.attempts, v.text, v.tokens = v.attempts + called, text, v.tokens + tokens
                v.prompt_tokens = prompt_tokens or v.prompt_tokens
                if error is not None:  # no answer after the endpoint's own retries, or no room: asking again won't help
                    v.error = error
                    continue
                v.score, why = parse_verdict(text, self.judge.verdict)
                v.error = None if why is None else f"unparsable: {why}"
                if why is not None:
                    retry.append(i)
            pending = retry

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def context_length(model_dir: str, trust_remote_code: bool) -> int:
    """The judge model's context (max_position_embeddings), as its engine takes it without judge.max_model_len."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)


def vllm_kwargs(judge: JudgeConfig) -> dict[str, Any]:
    """The judge's vllm.LLM arguments (an engine of its own: no sleep mode, no weight pushes)."""
    kwargs = {
        "tensor_parallel_size": judge.tensor_parallel_size,
        "enforce_eager": judge.enforce_eager,
        "trust_remote_code": judge.trust_remote_code,
    }
    return kwargs | ({"gpu_memory_utilization": judge.gpu_memory_utilization} if judge.gpus_per_actor else {})


def judge_group_columns(calls: JudgeCalls, table: pa.Table) -> tuple[dict[str, pa.Array], dict[str, float]]:
    """The judgements columns of a shard of rollout groups ([row][sample] lists), and its counts."""
    rows = table.select(
        [
            "prompt_id",
            "data_source",
            "messages_json",
            "prompt_text",
            "ground_truth",
            "extra_info_json",
            "response_texts",
        ]
    )
    verdicts, keys, sizes = [], [], []
    for row in rows.to_pylist():
        extra = json.loads(row["extra_info_json"]) if row["extra_info_json"] else {}
        rubric = extra.get(calls.judge.rubric_key) if isinstance(extra, dict) else None
        group = {
            "prompt": prompt_of(row),
            "ground_truth": row["ground_truth"],
            "rubric": rubric,
            "data_source": row["data_source"],
            "prompt_id": row["prompt_id"],
        }
        sizes.append(len(row["response_texts"]))
        for sample_idx, response in enumerate(row["response_texts"]):
            verdict = Verdict()
            try:
                verdict.messages = calls.messages({**group, "response": response})
            except ValueError as err:
                verdict.error = f"template: {err}"
            verdicts.append(verdict)
            keys.append((row["prompt_id"], sample_idx))
    calls.judge_all(verdicts, keys)
    return _columns(verdicts, sizes), _counts(verdicts)


def prompt_of(row: dict[str, Any]) -> str:
    """{prompt}: the text of the prompt's messages, one per line (the question as the dataset wrote it), not the
    policy's chat-templated prompt_text, whose special tokens mean nothing to another model; prompt_text when the
    row has no messages."""
    try:
        messages = json.loads(row["messages_json"] or "[]")
        texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    except (ValueError, TypeError, AttributeError):
        texts = []
    return "\n".join(texts) if texts else row["prompt_text"]


def _columns(verdicts: list[Verdict], sizes: list[int]) -> dict[str, pa.Array]:
    per_row, start = [], 0
    for size in sizes:
        per_row.append(verdicts[start : start + size])
        start += size

    def column(get, kind: pa.DataType) -> pa.Array:
        return pa.array([[get(v) for v in group] for group in per_row], pa.list_(kind))

    return {
        "judge_scores": column(lambda v: v.score, pa.float32()),
        "judge_texts": column(lambda v: v.text, pa.string()),
        "judge_attempts": column(lambda v: v.attempts, pa.int32()),
        "judge_errors": column(lambda v: v.error, pa.string()),
        "judge_prompt_tokens": column(lambda v: v.prompt_tokens, pa.int32()),
        "judge_tokens": column(lambda v: v.tokens, pa.int32()),
    }


def _counts(verdicts: list[Verdict]) -> dict[str, float]:
    judged = [v.score for v in verdicts if v.score is not None]
    return {
        "samples": len(verdicts),
        "judged": len(judged),
        "failed": len(verdicts) - len(judged),
        "attempts": sum(v.attempts for v in verdicts),
        "judge_tokens": sum(v.tokens for v in verdicts),
        "judge_prompt_tokens": sum(v.prompt_tokens for v in verdicts),
        "verdict_sum": float(sum(judged)),
    }
