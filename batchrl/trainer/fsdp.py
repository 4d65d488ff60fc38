"""What a rank sets up before it computes anything: the process group and the FSDP2-sharded model.

Why a module of its own: both the update ranks (`worker`) and the pre-update pass that loads a separate reference
model (`logprobs`) load and shard a checkpoint the same way, and the way is the part that must not differ between
them: float32 master weights, one FSDP group per decoder layer, gradients SUMMED across ranks, dropout off.

Departure from verl: dropout is off (eval mode) so that the recomputed old log-probs equal the first step's
log-probs exactly (ratio = 1 at the first step); with gradient checkpointing the decoder layers alone are put in
training mode, which is what transformers checks before checkpointing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from batchrl.trainer.spec import UpdateSpec, resolve_backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device


def init_distributed(spec: UpdateSpec) -> Dist:
    """Join the process group described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (set by the launcher)."""
    backend = resolve_backend(spec.update.backend)
    if spec.update.cpu_offload and backend != "nccl":  # "auto" resolved here, on the rank's own host
        raise ValueError(
            "cpu_offload=True needs GPUs (the nccl backend); on CPU the parameters already live in "
            "host memory. Set update.cpu_offload=false"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    import_distributed_modules()  # before the group exists: see close_process_group
    # On GPU, gloo serves the collectives on CPU tensors: DCP's object gathers and, with CPU offload, the
    # gradient-norm reduction over host-resident shards.
    dist.init_process_group(backend="cuda:nccl,cpu:gloo" if backend == "nccl" else backend)
    logger.info("rank %d/%d joined (%s on %s)", dist.get_rank(), dist.get_world_size(), backend, device)
    return Dist(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def load_model(path: str, *, gradient_checkpointing: bool = False) -> torch.nn.Module:
    """Load an HF causal LM in float32 (the master weights) on CPU; FSDP moves the shards."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def shard_model(model: torch.nn.Module, *, ctx: Dist, compute_dtype: str, cpu_offload: bool) -> None:
    """FSDP2: one shard group per decoder layer, then the root (embeddings, final norm, tied lm_head).

    bfloat16 compute: parameters are all-gathered and used in bf16, gradients reduced in fp32, master weights
    fp32. Gradients are SUMMED across ranks (force-sum, divide factor 1): the loss already carries the global
    normalisation, and plain sums work on every backend (gloo has no AVG / pre-multiplied sum).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    mp_policy = MixedPrecisionPolicy()
    if compute_dtype == "bfloat16":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    # A PEFT model (update.lora) is sharded as its base is, with itself as the root: its forward runs the hooks.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(base).__name__} has no model.layers; the FSDP2 trainer supports decoder-only HF models "
            "laid out like Llama/Qwen2 (model.model.layers[i])"
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def set_dropout_free_mode(model: torch.nn.Module) -> int:
    """eval() everywhere (no dropout), then training mode on the checkpointed decoder layers only.

    transformers checkpoints a layer only when `layer.gradient_checkpointing and layer.training`; the layer's
    submodules (attention, MLP, their dropout) stay in eval mode. Returns the number of checkpointed layers.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.eval()
    checkpointed = 0
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            module.training = True
            checkpointed += 1
    return checkpointed


GLOO_THREAD_PREFIXES = ("pt_gloo", "gloo_")  # the names gloo's worker and transport threads give themselves


def import_distributed_modules() -> None:
    """Import the torch.distributed modules a rank uses, before `init_process_group`: torch/distributed/nn/
    functional.py (imported by torch.distributed.fsdp) takes `group=group.WORLD` as the default of ten functions,
    evaluated at import, so imported after the group exists it holds the group for good (torch 2.13)."""
    import torch.distributed.checkpoint
    import torch.distributed.device_mesh
    import torch.distributed.fsdp  # noqa: F401


def close_process_group() -> list[str]:
    """Destroy the process group so that its backend's threads are joined now, while the interpreter is whole; the
    names of gloo threads still running after it (empty when the group was destroyed). Call it last, once the
    models are dropped: the device meshes lose their process groups.

    Why not `dist.destroy_process_group()` alone: issue 30's "terminate called without an active exception", a
    rank's SIGABRT at exit, read in gdb. `destroy_process_group` only unregisters the group; the C++ group, and
    gloo's two worker threads with it, live until the last reference goes. Two references outlive it in a rank:
    DTensor keeps the specs of the ops it saw, and through them the device mesh, whose registry holds the group
    (cleared here); and torch.distributed.nn.functional's default arguments, when imported after the group exists
    (`import_distributed_modules`). With the threads alive into interpreter finalisation, a worker that finishes
    an operation releases its tensors; a tensor that owns its Python object takes the GIL to release it; CPython
    3.11 ends a thread that takes the GIL during finalisation with pthread_exit, and its forced unwinding through
    gloo's noexcept ~AsyncWork calls std::terminate. Upstream: pytorch/pytorch#109478 (groups not destroyed at
    exit), #179291 (an exit handler for this crash, abandoned); CPython 3.14 parks such threads instead of ending
    them (python/cpython#87135). Both references, and the threads this joins, are pinned in
    tests/unit/test_gloo_teardown.py.
    """
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()  # models, optimizers and FSDP states the caller dropped, some of them in reference cycles
    # type(), not isinstance(): the latter reads __class__, which some objects (lazy modules, proxies) compute
    for mesh in [obj for obj in gc.get_objects() if issubclass(type(obj), DeviceMesh)]:
        registry = getattr(mesh, "_pg_registry", None)  # torch 2.13: group name -> ProcessGroup
        if isinstance(registry, dict):
            registry.clear()
    dist.destroy_process_group()
    gc.collect()
    return gloo_threads()


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (Linux: /proc/self/task; elsewhere none are seen)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(GLOO_THREAD_PREFIXES):
            names.append(name)
    return sorted(names)
