"""Code that runs inside each vLLM worker: new policy weights read from a checkpoint directory by the worker itself.

Why the worker reads the files: the engine's workers may live in other processes (vLLM's multiprocess engine core,
tensor parallelism, the Ray executor), and a `collective_rpc` to them carries only what msgpack can encode: no live
iterator of tensors, no callable unless VLLM_ALLOW_INSECURE_SERIALIZATION is set. A method mixed into vLLM's worker
class (`worker_extension_cls`) is called by name with a path, so the same push works in every engine layout; each
tensor-parallel worker streams the whole checkpoint, one tensor at a time, and its weight loaders keep its shard.

Why an lm_head alias: a checkpoint with tied embeddings has no `lm_head.weight`, but a layerwise reload replaces
the embedding's tensor, and vLLM's CPU backend keeps a repacked copy of the output projection besides: fed only
the embedding, the engine goes on generating with the old output layer, silently (tests/stages/test_engines.py
checks the pushed engine against a transformers forward of the new weights).
"""

from __future__ import annotations

import logging

from batchrl.engines.base import checkpoint_tensors


class _DropRotaryReloadNotice(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" warning of a reload, which is harmless.

    Why harmless: a layerwise reload counts a layer's buffers as loadable, and RotaryEmbedding's only one is its
    cos/sin cache, which vLLM computes from the model config and no checkpoint contains. Finding no weight for
    it, vLLM puts the existing cache back (`_place_kernel_tensors`), and that cache is the right one: it does not
    depend on the weights. Any other layer's failure is still reported.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def _quiet_reload_logger() -> None:
    reload_logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _DropRotaryReloadNotice) for f in reload_logger.filters):
        reload_logger.addFilter(_DropRotaryReloadNotice())


class CheckpointLoader:
    """Mixed into vLLM's worker class (engine argument worker_extension_cls); adds one RPC-callable method."""

    def batchrl_load_checkpoint(self, checkpoint_dir: str) -> None:
        """Reloads every weight from the checkpoint directory (a local path on this worker's host), in place."""
        hf_config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        _quiet_reload_logger()
        tensors = checkpoint_tensors(checkpoint_dir, tied_lm_head=tied)
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
