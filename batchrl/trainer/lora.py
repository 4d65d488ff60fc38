"""LoRA (update.lora): the update trains a PEFT adapter over the frozen base model instead of every weight.

Why PEFT and not our own layers: its adapters are what vLLM's LoRA serving, TRL and every PEFT user load, and its
`disable_adapter()` gives the reference policy (the base) from the same weights, with no second copy of them.

How it fits the FSDP2 trainer (`fsdp`): the PEFT model is built on CPU before sharding, then sharded as a full
model is (a group per decoder layer, then the root), with the PeftModel as the root so that its forward runs the
root's hooks. FSDP2 shards each parameter on its own, so a layer's frozen base weights and trainable adapter
weights share a group without the `use_orig_params` care FSDP1 needed; gradients exist for the adapter only, and
the optimizer (`training.new_optimizer`) holds the parameters that require grad, so its state and the saved trainer
state hold the adapter's only.

The base is always model.path (`UpdateSpec.lora_base`); what continues from iteration to iteration is the adapter:
each policy/ holds it in `policy/adapter/` (PEFT's format) beside the merged checkpoint (base + B@A * alpha/r) that
the engines, evaluate, warm starts and the integrity checks read as any full checkpoint. The next update loads
base + that adapter, never the merged weights, as its trainable state.

Departure from verl: dropout applies in the optimizer steps only (`set_adapter_dropout`): the pre-update
log-probs are computed without it, as batchrl computes them with the rest of the model's dropout off.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from batchrl.config.models import UpdateConfig
from batchrl.trainer.checkpoint import replace_dir
from batchrl.trainer.fsdp import load_model

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # policy/adapter/: adapter_config.json + adapter_model.safetensors


def peft_config(update: UpdateConfig):
    """PEFT's LoraConfig of update.lora, for a causal LM."""
    from peft import LoraConfig as PeftLoraConfig

    lora = update.lora
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def unmatched_targets(module_names: list[str], targets: list[str] | str) -> list[str]:
    """The names of `targets` that match none of `module_names`, by PEFT's own rule (a module matches a name when
    its qualified name is the name or ends with "." + name). all-linear matches by construction."""
    from peft import LoraConfig as PeftLoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    if isinstance(targets, str):
        return []
    return [
        target
        for target in targets
        if not any(check_target_module_exists(PeftLoraConfig(target_modules=[target]), key) for key in module_names)
    ]


def model_module_names(path: str) -> list[str]:
    """The qualified module names of the causal LM at `path`, built from its config on the meta device (no
    weights are read or allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, _ in model.named_modules()]


def adapter_source(policy_in: str, *, lora_base: str, init_from_adapter: str | None) -> str | None:
    """The adapter this update continues: the input policy's (policy_in/adapter/, written by the previous update),
    else update.lora.init_from_adapter when the input policy is the base, else None (a fresh adapter). An input
    policy that holds no adapter and other weights than the base (run.init_from naming a fully fine-tuned run)
    cannot be continued as an adapter over the base: an error, not a silent restart from the base."""
    if (Path(policy_in) / ADAPTER_DIR / "adapter_config.json").is_file():
        return str(Path(policy_in) / ADAPTER_DIR)
    if os.path.realpath(policy_in) != os.path.realpath(lora_base) and not same_weights(policy_in, lora_base):
        raise ValueError(
            f"update.lora: the input policy {policy_in} has no {ADAPTER_DIR}/ and is not model.path ({lora_base}); "
            "an adapter continues only an adapter. Warm-start (run.init_from) from a LoRA run, or remove update.lora"
        )
    return init_from_adapter


def with_local_init_adapter(update: UpdateConfig, *, policy_in: str, scratch: Path) -> UpdateConfig:
    """`update` with update.lora.init_from_adapter on object storage downloaded under `scratch` and named by its
    local path there, when this update continues it (`policy_in`, local, holds no adapter/); else `update` as it is.
    Downloaded each time, not cached: an adapter is small, and one re-written at the same URI must not be served
    from a stale copy."""
    from batchrl.storage import download_dir, is_local

    lora = update.lora
    if lora is None or lora.init_from_adapter is None or is_local(lora.init_from_adapter):
        return update
    if (Path(policy_in) / ADAPTER_DIR / "adapter_config.json").is_file():
        return update  # a later iteration: the input policy's own adapter continues
    local = download_dir(lora.init_from_adapter, str(scratch / "init_adapter"))
    logger.info("downloaded update.lora.init_from_adapter %s to %s", lora.init_from_adapter, local)
    return update.model_copy(update={"lora": lora.model_copy(update={"init_from_adapter": local})})


def same_weights(a: str, b: str) -> bool:
    """Whether two local checkpoints hold the same weight files, byte for byte (a copy of the base: an update that
    had no rows to train on carries its input policy forward, and at the first iteration that is model.path)."""
    from batchrl.trainer.integrity import file_sha256

    files_a, files_b = sorted(Path(a).glob("*.safetensors")), sorted(Path(b).glob("*.safetensors"))
    return (
        bool(files_a)
        and [f.name for f in files_a] == [f.name for f in files_b]
        and all(file_sha256(x) == file_sha256(y) for x, y in zip(files_a, files_b))
    )


def build_lora_model(
    *, policy_in: str, lora_base: str, update: UpdateConfig, gradient_checkpointing: bool
) -> torch.nn.Module:
    """The PEFT model on CPU, before sharding: the base (float32, frozen) with the adapter to train, continued
    from `adapter_source` or fresh (A random from the seeded generator, the same on every rank; B zero)."""
    from peft import PeftModel, get_peft_model

    base = load_model(lora_base, gradient_checkpointing=gradient_checkpointing)
    source = adapter_source(policy_in, lora_base=lora_base, init_from_adapter=update.lora.init_from_adapter)
    if source is None:
        model = get_peft_model(base, peft_config(update))
    else:
        model = PeftModel.from_pretrained(base, source, is_trainable=True)
        logger.info("continuing the LoRA adapter of %s", source)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA: %d trainable parameters of %d (%.2f%%)", trainable, total, 100 * trainable / total)
    return model


class AdapterDisabled:
    """The reference policy of a LoRA update: calls `model` with its adapter disabled (the base weights, shared,
    not copied). Everything else (config, forward's signature, reshard) is the model's."""

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def __call__(self, *args, **kwargs):
        with self._model.disable_adapter():
            return self._model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def set_adapter_dropout(model: torch.nn.Module, *, active: bool) -> None:
    """Training mode on the adapters' dropout modules (update.lora.dropout > 0) for the optimizer steps, eval mode
    for the log-prob passes; the rest of the model stays as `fsdp.set_dropout_free_mode` left it."""
    for name, module in model.named_modules():
        if name.endswith(".lora_dropout.default"):
            module.train(active)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's parameters, whole, on CPU (a collective: every rank gathers the same ones in the same order)."""
    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            state[name] = full.detach().to("cpu", torch.float32)
    return state


def save_lora_policy(model: torch.nn.Module, tokenizer, *, policy_out: str, lora_base: str, rank: int) -> None:
    """policy_out/: the merged HF checkpoint (base + B@A * alpha/r, float32) and policy_out/adapter/ (PEFT's
    format). Only the adapter is gathered; rank 0 rebuilds the PEFT model on CPU from the base on disk, loads the
    adapter into it, saves it, then merges with PEFT and saves the merged model. A collective."""
    import torch.distributed as dist
    from peft import get_peft_model

    state = adapter_state(model)
    if rank == 0:
        out_dir = Path(policy_out)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
        cpu_model = get_peft_model(load_model(lora_base), model.peft_config["default"])
        result = cpu_model.load_state_dict(state, strict=False)
        if result.unexpected_keys or len(state) == 0:
            raise RuntimeError(f"the adapter's parameters do not fit a fresh PEFT model: {result.unexpected_keys}")
        cpu_model.save_pretrained(str(tmp_dir / ADAPTER_DIR))
        merged = cpu_model.merge_and_unload()
        merged.save_pretrained(str(tmp_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp_dir))
        replace_dir(tmp_dir, out_dir)
        logger.info("saved the LoRA adapter and the merged policy to %s", out_dir)
    dist.barrier()
