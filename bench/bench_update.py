"""Policy update: batchrl's FSDP2 trainer vs a bare torch forward/backward/AdamW loop, and padding waste.

1. Throughput: one update (1 process, PPO-clip, token-budget micro-batches, several optimizer steps) on a
   small Qwen2 and a batch with a realistic length spread, against a bare loop in this process on the same
   model, the same padded micro-batches and the same number of AdamW steps (plain log-softmax policy-gradient
   loss, no FSDP). Both are timed after a no-grad warm-up pass (the trainer's is its old-log-prob pass).
   Prints trainer tokens/s divided by bare-loop tokens/s (target >= 0.85), from the fastest optimizer step of
   each (the trainer reports perf/step_time_min_s), which is the least disturbed one on a shared machine.
2. Padding: padded tokens / real tokens of the token-budget micro-batches on a GSM8K-like length
   distribution (target <= 1.1), and, for contrast, of fixed-size micro-batches in table order.
3. Shared prompts (update.share_prompt): the same trainer update with and without, on groups of 8 samples
   that share their prompt, in two shapes: the quickstart's (25-token prompts, ~5-token responses) and a
   GSM8K-like one at this bench's scale (~45-token prompts, ~75-token responses). Prints the fastest step's
   time without / with (> 1: sharing is faster). No target: it says where sharing pays.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from batchrl.config.models import UpdateConfig
from batchrl.trainer import UpdateSpec, run_update
from batchrl.trainer.batching import padding_ratio, plan_micro_batches
from batchrl.trainer.index import read_index
from batchrl.trainer.rows import RowReader
from batchrl_toy import build_toy_model


def build_bench_model(path: Path) -> None:
    """The toy architecture scaled up (4 layers, hidden 256) that both parts of this bench train."""
    build_toy_model(
        path, hidden_size=256, intermediate_size=704, num_layers=4, num_attention_heads=4, num_key_value_heads=2, seed=0
    )


def realistic_lengths(
    rng: np.random.Generator, num_samples: int, *, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ~ N(180, 40) tokens; responses log-normal around 300 with a long tail to the 2048 cap."""
    prompts = rng.normal(180 * scale, 40 * scale, num_samples).clip(8, 512 * scale).astype(int)
    responses = np.exp(rng.normal(np.log(300 * scale), 0.7, num_samples)).clip(1, 2048 * scale).astype(int)
    return prompts, responses


def write_batch(path: Path, *, vocab_size: int, num_prompts: int, samples_per_prompt: int, scale: float) -> None:
    rng = np.random.default_rng(0)
    prompt_lengths, response_lengths = realistic_lengths(rng, num_prompts * samples_per_prompt, scale=scale)
    rows = []
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        rows.append(
            {
                "prompt_id": f"p{i // samples_per_prompt:04d}",
                "sample_idx": i % samples_per_prompt,
                "prompt_token_ids": rng.integers(3, vocab_size, p).tolist(),
                "response_token_ids": rng.integers(3, vocab_size, r).tolist(),
                "response_logprobs": (-3 * rng.random(r)).tolist(),
                "advantage": float(rng.normal()),
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_groups(
    path: Path, *, vocab_size: int, num_prompts: int, samples_per_prompt: int, prompt_mean: int, response_median: int
) -> None:
    """GRPO-shaped batch: every sample of a group has the group's prompt; log-normal response lengths."""
    rng = np.random.default_rng(2)
    rows = []
    for p in range(num_prompts):
        prompt = rng.integers(3, vocab_size, max(4, int(rng.normal(prompt_mean, prompt_mean / 5)))).tolist()
        for k in range(samples_per_prompt):
            length = int(np.clip(np.exp(rng.normal(np.log(response_median), 0.5)), 1, 8 * response_median))
            rows.append(
                {
                    "prompt_id": f"p{p:04d}",
                    "sample_idx": k,
                    "prompt_token_ids": prompt,
                    "response_token_ids": rng.integers(3, vocab_size, length).tolist(),
                    "response_logprobs": (-3 * rng.random(length)).tolist(),
                    "advantage": float(rng.normal()),
                }
            )
    pq.write_table(pa.Table.from_pylist(rows), path)


def shared_prompt_speedup(
    spec: UpdateSpec, tmp: Path, *, vocab_size: int, name: str, prompt_mean: int, response_median: int, repeats: int
) -> float:
    """Fastest step without share_prompt / with it, on a GRPO-shaped batch (32 prompts x 8 samples, 4 steps)."""
    advantages = tmp / f"groups-{name}.parquet"
    write_groups(
        advantages,
        vocab_size=vocab_size,
        num_prompts=32,
        samples_per_prompt=8,
        prompt_mean=prompt_mean,
        response_median=response_median,
    )
    spec = dataclasses.replace(
        spec.with_update(ppo_epochs=1, ppo_mini_batch_size=8), advantages_files=[str(advantages)]
    )
    best = {False: [], True: []}
    for _ in range(repeats):  # interleaved
        for share in (False, True):
            metrics = run_update(spec.with_update(share_prompt=share), timeout_s=1800)
            best[share].append((metrics["perf/step_time_min_s"], metrics["perf/real_tokens"]))
    (plain_s, plain_tokens), (shared_s, shared_tokens) = min(best[False]), min(best[True])
    print(
        f"shared prompts, {name}: step {plain_s:.3f} s -> {shared_s:.3f} s, tokens computed per update "
        f"{plain_tokens:.0f} -> {shared_tokens:.0f}"
    )
    return plain_s / shared_s


def bare_batch(samples, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, attention mask, labels, advantage x response mask) of right-padded samples: the textbook way."""
    length = max(len(samples.prompt_token_ids[i]) + len(samples.response_token_ids[i]) for i in indices)
    input_ids, attention = torch.zeros((len(indices), length), dtype=torch.long), torch.zeros((len(indices), length))
    weights = torch.zeros((len(indices), length))
    for row, i in enumerate(indices):
        prompt, response = samples.prompt_token_ids[i], samples.response_token_ids[i]
        input_ids[row, : len(prompt) + len(response)] = torch.tensor(np.concatenate([prompt, response]))
        attention[row, : len(prompt) + len(response)] = 1
        weights[row, len(prompt) : len(prompt) + len(response)] = float(samples.advantages_N[i])
    return input_ids, attention.long(), input_ids[:, 1:], weights[:, 1:]


def bare_loop(policy_dir: str, advantages: str, *, steps: int, max_tokens: int, lr: float) -> tuple[float, int]:
    """(fastest step's seconds, real tokens per step) of `steps` plain AdamW steps over the same micro-batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    index = read_index([str(advantages)])
    samples = RowReader(index, with_rollout_logprobs=False).read(np.arange(index.num_samples))
    plan = plan_micro_batches(samples.lengths_N, world_size=1, max_tokens=max_tokens)[0]
    batches = [bare_batch(samples, chunk) for chunk in plan]
    num_tokens = int(samples.loss_tokens_N.sum())
    with torch.no_grad():
        for input_ids, attention, _, _ in batches:  # warm-up, like the trainer's old-log-prob pass
            model(input_ids=input_ids, attention_mask=attention)
    step_times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for input_ids, attention, labels, weights in batches:
            logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
            logprobs = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            loss = -(logprobs * weights).sum() / num_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step_times.append(time.perf_counter() - started)
    return min(step_times), sum(int(attention.sum()) for _, attention, _, _ in batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="trainer/bare-loop pairs, interleaved; best of each")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--length-scale", type=float, default=0.25, help="shrinks the lengths to fit a CPU run")
    parser.add_argument("--max-tokens", type=int, default=4096)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-update-") as tmp:
        policy = Path(tmp) / "policy"
        build_bench_model(policy)
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(str(policy)).vocab_size
        advantages = Path(tmp) / "advantages.parquet"
        write_batch(
            advantages,
            vocab_size=vocab_size,
            num_prompts=args.prompts,
            samples_per_prompt=args.samples_per_prompt,
            scale=args.length_scale,
        )
        spec = UpdateSpec(
            policy_in=str(policy),
            policy_out=str(Path(tmp) / "out"),
            advantages_files=[str(advantages)],
            metrics_path=str(Path(tmp) / "metrics.json"),
            update=UpdateConfig(
                backend="gloo",
                lr=1e-5,
                ppo_epochs=args.steps,
                max_tokens_per_micro_batch=args.max_tokens,
                dual_clip_ratio=None,
            ),
        )  # the bare loop's plain PPO loss
        trainer_runs, bare_runs = [], []
        for _ in range(args.repeats):  # interleaved, so a busy spell on a shared machine hits both
            trainer_runs.append(run_update(spec, timeout_s=1800))
            bare_runs.append(
                bare_loop(str(policy), str(advantages), steps=args.steps, max_tokens=args.max_tokens, lr=1e-5)
            )
    # Fastest step of each: on a shared machine the minimum is the least disturbed measurement.
    trainer_step_s = min(m["perf/step_time_min_s"] for m in trainer_runs)
    bare_step_s, tokens_per_step = min(bare_runs)
    trainer_tps, bare_tps = tokens_per_step / trainer_step_s, tokens_per_step / bare_step_s
    print(
        f"update, {tokens_per_step} tokens per optimizer step: trainer {trainer_tps:.0f} tok/s ({trainer_step_s:.2f} s "
        f"per step), bare torch loop {bare_tps:.0f} tok/s ({bare_step_s:.2f} s); trainer padding "
        f"{trainer_runs[0]['perf/padding_ratio']:.3f}"
    )
    print(f"RESULT update_tokens_per_s_vs_bare_loop={trainer_tps / bare_tps:.2f} (target >= 0.85)")

    lengths_N = np.add(*realistic_lengths(np.random.default_rng(1), 4096))
    budget_plan = plan_micro_batches(lengths_N, world_size=8, max_tokens=16384)
    table_order = [[list(range(s, s + 8)) for s in range(r * 512, (r + 1) * 512, 8)] for r in range(8)]
    print(
        f"padding on 4096 GSM8K-like samples, 8 ranks: token budget 16384 {padding_ratio(budget_plan, lengths_N):.3f}, "
        f"8 samples per micro-batch in table order {padding_ratio(table_order, lengths_N):.3f}"
    )
    print(f"RESULT update_padded_over_real_tokens={padding_ratio(budget_plan, lengths_N):.3f} (target <= 1.1)")

    with tempfile.TemporaryDirectory(prefix="bench-update-shared-") as tmp:
        policy = Path(tmp) / "policy"
        build_bench_model(policy)
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(str(policy)).vocab_size
        spec = UpdateSpec(
            policy_in=str(policy),
            policy_out=str(Path(tmp) / "out"),
            advantages_files=["unused"],
            metrics_path=str(Path(tmp) / "metrics.json"),
            update=UpdateConfig(
                backend="gloo", lr=1e-5, max_tokens_per_micro_batch=args.max_tokens, old_logprobs="rollout"
            ),
        )
        for name, prompt_mean, response_median in (("short_responses", 25, 5), ("gsm8k_like", 45, 75)):
            speedup = shared_prompt_speedup(
                spec,
                Path(tmp),
                vocab_size=vocab_size,
                name=name,
                prompt_mean=prompt_mean,
                response_median=response_median,
                repeats=args.repeats,
            )
            print(f"RESULT update_shared_prompt_speedup_{name}={speedup:.2f} (step time without / with share_prompt)")


if __name__ == "__main__":
    main()
