"""The project's GPU smoke check (`make gpu-smoke`): each GPU path of batchrl, on a model built here, PASS or FAIL.

Why a script and not only tests: a GPU host is lent for minutes, and what a first GPU run must tell is more than
pass/fail: the time and peak device memory of each step, tokens per second generated and trained, and whether a
sleeping engine wakes faster than a rebuilt one. Nothing is downloaded: the model is a Qwen2-architecture
checkpoint with tied embeddings (like Qwen2.5-0.5B's) and the toy tokenizer, built from a config (`--size 100m`:
~100M parameters; `tiny`: the 1.3M toy model), and the prompts are the toy arithmetic.

Steps (`--steps`, in this order):
- install: `pip install '.[gpu]'` into a fresh venv (with a GPU), else pip's resolver only (`--dry-run`): the
  versions `[gpu]` resolves to today, checked against the floors in pyproject.toml.
- generate: a vLLM engine (bfloat16 with CUDA graphs on a GPU; float32 on CPU) generates seeded samples twice; the
  two must be identical. Also the tokens/s of the same prompts unseeded, n samples per request: what a seed per
  sample (batchrl's reproducible sampling) costs.
- push: after `load_checkpoint` of other weights, the engine's log-probs must match a transformers forward of the
  NEW weights, not the old. The engine is generate's, kept open for it (a run pushes into an engine that has
  generated, its prefix cache full of the old weights' blocks), else one built here. On a GPU also: sleep (level
  2), the device memory that freed, and wake + push vs a rebuild. `--layout` runs the engine core in this process,
  in another (multiprocess), or tensor-parallel.
- update: a 1-rank FSDP2 update (NCCL on a GPU, gloo on CPU), then one that resumes from its optimizer state.
- pipeline: a 2-iteration pipeline with the GPU profiles (CPU ones without a GPU), then a rerun that must skip
  every stage.
- tests: the repo's `gpu`-marked tests (a CPU machine has none to run: SKIP).

Exit status 0 when no step failed. On a CPU machine, CI runs the CPU-runnable steps on the tiny model
(tests/pipeline/test_gpu_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STEPS = ("install", "generate", "push", "update", "pipeline", "tests")
VERDICTS = ("PASS ", "FAIL ", "SKIP ")
SIZES = {  # build_toy_model arguments
    "100m": {
        "num_layers": 16,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "intermediate_size": 2048,
    },
    "tiny": {},
}
LAYOUTS = {  # engine_kwargs and environment of each engine layout
    "inprocess": ({}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    "multiprocess": ({}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
    "tp2": ({"tensor_parallel_size": 2}, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
}


class Skip(Exception):
    """A step that cannot run here (no GPU, nothing to run); its message says why."""


@dataclass
class Smoke:
    out: Path
    size: str
    layout: str
    cuda: bool
    results: dict[str, Any] = field(default_factory=dict)  # what one step leaves for the next (the engine's build time)
    engine: Any = None  # generate's engine, kept for a push step right after it (run_steps closes it otherwise)

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.cuda else "float32"

    def model(self, name: str, *, seed: int) -> str:
        """The smoke model with `seed`'s random weights, built once under out/."""
        from batchrl_toy import build_toy_model

        path = self.out / f"model-{self.size}-{name}"
        if not (path / "config.json").exists():
            build_toy_model(path, seed=seed, **SIZES[self.size])
        return str(path)


# ----------------------------------------------------------------------------------------------------- steps


def step_install(smoke: Smoke) -> str:
    """With a GPU: the [gpu] extra into a fresh venv. Without: what pip's resolver picks for it, against our floors."""
    if smoke.cuda:
        venv = smoke.out / "venv-gpu"
        _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
        _run([str(venv / "bin" / "pip"), "install", "-q", f"{REPO}[gpu]"], timeout=1800)
        versions = _run([str(venv / "bin" / "python"), "-c", _VERSIONS_SCRIPT], timeout=300).strip()
        return f"installed: {versions}"
    floors = _floors()
    sets = {  # what pip must be able to install: the extra as it resolves today, and at our floors
        "[gpu] today": [f"{REPO}[gpu]"],
        "[gpu] at the floors": [f"{REPO}[gpu]", f"vllm=={floors['vllm']}", f"transformers=={floors['transformers']}"],
        "base at the floors": [str(REPO), f"torch=={floors['torch']}", f"transformers=={floors['transformers']}"],
    }
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(sets)) as pool:
        reports = [smoke.out / f"resolve-{index}.json" for index in range(len(sets))]
        resolved = dict(zip(sets, pool.map(_resolve, reports, sets.values())))
    problems = [
        f"{what}: {name} {versions[name]} is below the floor {floor}"
        for what, versions in resolved.items()
        for name, floor in floors.items()
        if name in versions and _version(versions[name]) < _version(floor)
    ]
    if problems:
        raise AssertionError("; ".join(problems))
    return "; ".join(
        f"{what}: " + ", ".join(f"{n} {versions[n]}" for n in ("vllm", "torch", "transformers") if n in versions)
        for what, versions in resolved.items()
    )


def _resolve(report: Path, requirements: list[str]) -> dict[str, str]:
    """The versions pip's resolver picks for the requirements (nothing is installed)."""
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "-q",
            "--report",
            str(report),
            *requirements,
        ],
        timeout=900,
    )
    return {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }


_VERSIONS_SCRIPT = (
    "import torch, vllm, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, "
    "'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
)


def step_generate(smoke: Smoke) -> str:
    """Seeded samples twice from one engine: they must be identical. Records the build time for the push step."""
    from batchrl.engines import SamplingSpec

    started = time.perf_counter()
    engine = smoke.engine = _engine(smoke, smoke.model("old", seed=0))  # closed by run_steps, or the push step's
    build_s = time.perf_counter() - started
    prompts = _prompts(smoke)
    seeds = [[1000 * p + s for s in range(4)] for p in range(len(prompts))]
    sampling = SamplingSpec(max_new_tokens=128)
    first = engine.generate(prompts, seeds=seeds, sampling=sampling)  # the first call warms the engine up
    started = time.perf_counter()
    again = engine.generate(prompts, seeds=seeds, sampling=sampling)
    seeded_s = time.perf_counter() - started
    unseeded_rate = _unseeded_rate(engine, prompts, samples=4, max_new_tokens=128)
    if [[r.token_ids for r in g] for g in first] != [[r.token_ids for r in g] for g in again]:
        raise AssertionError("the same seeds gave different samples")
    tokens = sum(len(r.token_ids) for group in again for r in group)
    smoke.results["engine_build_s"] = build_s
    return (
        f"engine built in {build_s:.1f} s; repeats; {tokens / seeded_s:.0f} tokens/s generated with a seed per sample, "
        f"{unseeded_rate:.0f} without seeds (n=4 per request)"
    )


def _unseeded_rate(engine: Any, prompts: list[list[int]], *, samples: int, max_new_tokens: int) -> float:
    """Tokens/s of the same prompts as one request each with n samples and no seed, the way vLLM samples fastest
    (a seeded request draws from its own generator): what batchrl's reproducible sampling costs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=samples, max_tokens=max_new_tokens, temperature=1.0)
    started = time.perf_counter()
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return sum(len(c.token_ids) for output in outputs for c in output.outputs) / elapsed


def step_push(smoke: Smoke) -> str:
    """load_checkpoint of other weights; the engine's log-probs must be those of the new weights. On a GPU, the
    same after a sleep: the memory freed, and wake + push against a rebuild."""
    old, new = smoke.model("old", seed=0), smoke.model("new", seed=1)
    engine, smoke.engine = smoke.engine or _engine(smoke, old), None  # generate's engine serves the old weights
    try:
        started = time.perf_counter()
        engine.load_checkpoint(new)
        detail = f"push {time.perf_counter() - started:.2f} s, " + _check_new_weights(smoke, engine, old=old, new=new)
        if smoke.cuda:
            detail += "; " + _sleep_and_wake(smoke, engine, old=old, new=new)
    finally:
        engine.close()
    return detail


def _sleep_and_wake(smoke: Smoke, engine: Any, *, old: str, new: str) -> str:
    import torch

    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    engine.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_before
    started = time.perf_counter()
    engine.load_checkpoint(new)
    wake_s = time.perf_counter() - started
    check = _check_new_weights(smoke, engine, old=old, new=new)
    rebuild_s = smoke.results.get("engine_build_s", float("nan"))
    return (
        f"sleep freed {freed / 2**30:.2f} GiB; wake + push {wake_s:.2f} s vs rebuild {rebuild_s:.1f} s; "
        f"after wake {check}"
    )


def _check_new_weights(smoke: Smoke, engine: Any, *, old: str, new: str) -> str:
    """Sampled responses' log-probs from the engine against transformers forwards of the new and the old weights."""
    from batchrl.engines import SamplingSpec

    prompts = _prompts(smoke)[:8]
    groups = engine.generate(prompts, seeds=[[7, 8]] * len(prompts), sampling=SamplingSpec(max_new_tokens=32))
    samples = [(prompt, record) for prompt, group in zip(prompts, groups) for record in group if record.token_ids]
    to_new = _logprob_gap(new, samples, dtype=smoke.dtype)
    to_old = _logprob_gap(old, samples, dtype=smoke.dtype)
    if not to_new < 0.2 * to_old:
        raise AssertionError(
            f"the engine's log-probs are {to_new:.4f} from the new weights' and {to_old:.4f} from the old ones' "
            "(mean |difference|): the push did not reach the model"
        )
    return f"log-probs {to_new:.1e} from the new weights', {to_old:.1e} from the old's"


def _logprob_gap(model_dir: str, samples: list[tuple[list[int], Any]], *, dtype: str) -> float:
    """Mean |engine log-prob - transformers log-prob| over the samples' tokens, under model_dir's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, record in samples:
            ids = torch.tensor([prompt + record.token_ids], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            reference = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()
            total += float((torch.tensor(record.logprobs) - reference).abs().sum())
            count += len(record.token_ids)
    del model
    return total / max(count, 1)


def step_update(smoke: Smoke) -> str:
    """A 1-rank update from synthetic advantages, then a second that resumes from the first's optimizer state."""
    from batchrl.config.models import UpdateConfig
    from batchrl.trainer import UpdateSpec, run_update

    base = smoke.model("old", seed=0)
    advantages = _synthetic_advantages(smoke.out / "advantages.parquet", model_dir=base)
    update = UpdateConfig(backend="nccl" if smoke.cuda else "gloo", num_processes=1, micro_batch_size=8, lr=1e-5)
    metrics = []
    policy_in, state_in = base, None
    for round_ in (1, 2):
        spec = UpdateSpec(
            policy_in=policy_in,
            policy_out=str(smoke.out / f"policy-{round_}"),
            advantages_files=[advantages],
            metrics_path=str(smoke.out / f"update-{round_}.json"),
            update=update,
            dtype=smoke.dtype,
            trainer_state_in=state_in,
            trainer_state_out=str(smoke.out / f"state-{round_}"),
            seed=round_,
        )
        started = time.perf_counter()
        metrics.append(run_update(spec, timeout_s=600) | {"wall_s": time.perf_counter() - started})
        policy_in, state_in = spec.policy_out, spec.trainer_state_out
    first, second = metrics
    expected_step = first["actor/global_step"] + second["actor/num_optimizer_steps"]
    if second["actor/global_step"] != expected_step:
        raise AssertionError(f"the resumed update is at global step {second['actor/global_step']}, not {expected_step}")
    rate = second["perf/real_tokens"] / second["wall_s"]
    resumed_at = first["actor/global_step"]
    return (
        f"{first['wall_s']:.1f} s then {second['wall_s']:.1f} s (resumed at step {resumed_at:.0f}); "
        f"{rate:.0f} tokens/s trained (process start included)"
    )


def _synthetic_advantages(path: Path, *, model_dir: str, num_prompts: int = 16, samples: int = 4) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    rows = [
        {
            "prompt_id": f"p{p}",
            "sample_idx": s,
            "prompt_token_ids": rng.integers(3, vocab_size, 24).tolist(),
            "response_token_ids": rng.integers(3, vocab_size, 64).tolist(),
            "response_logprobs": [-5.8] * 64,
            "advantage": float(rng.standard_normal()),
        }
        for p in range(num_prompts)
        for s in range(samples)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def step_pipeline(smoke: Smoke) -> str:
    """Two iterations with the GPU profiles (CPU ones without a GPU); a rerun must skip every stage."""
    from batchrl_toy import build_arith_prompts

    prompts = smoke.out / "prompts"
    if not prompts.exists():
        build_arith_prompts(str(prompts), num_prompts=32, num_shards=2, seed=0)
    shutil.rmtree(smoke.out / "runs", ignore_errors=True)  # a fresh run, even in a reused --out
    pipeline = smoke.out / "pipeline.yaml"
    pipeline.write_text(json.dumps(_pipeline_config(smoke, prompts), indent=1))  # JSON is YAML
    started = time.perf_counter()
    first = _run([_batchrl(), "run", str(pipeline)], timeout=1200)
    first_s = time.perf_counter() - started
    again = _run([_batchrl(), "run", str(pipeline)], timeout=600)
    ran, rerun = _stage_counts(first), _stage_counts(again)
    if rerun[0] != 0 or rerun[1] != sum(ran):
        raise AssertionError(f"the rerun ran {rerun[0]} stage(s) and skipped {rerun[1]}, of the {sum(ran)} done")
    return f"ran {ran[0]} stages in {first_s:.0f} s; the rerun skipped all {rerun[1]}"


def _stage_counts(output: str) -> tuple[int, int]:
    """(ran, skipped) from `batchrl run`'s summary line."""
    import re

    found = re.search(r": ran (\d+) stage\(s\), skipped (\d+)", output)
    if found is None:
        raise AssertionError(f"no run summary in batchrl run's output: {output[-500:]}")
    return int(found.group(1)), int(found.group(2))


def _pipeline_config(smoke: Smoke, prompts: Path) -> dict[str, Any]:
    profiles = ["engine/vllm_gpu", "trainer/gpu_nccl"] if smoke.cuda else ["engine/vllm_cpu", "trainer/cpu_gloo"]
    return {
        "name": "gpu-smoke",
        "profiles": [*profiles, "cluster/local"],
        "run": {"root": str(smoke.out / "runs"), "seed": 0, "iterations": 2},
        "model": {"path": smoke.model("old", seed=0), "dtype": smoke.dtype},
        "data": {"train_files": [str(prompts)], "shard_size": 32, "max_prompt_tokens": 64},
        "generate": {"num_samples_per_prompt": 4, "max_new_tokens": 32},
        "update": {"num_processes": 1, "micro_batch_size": 8, "ppo_mini_batch_size": 16},
        "tracking": {"progress_bars": False},
    } | ({} if smoke.cuda else {"ray": {"num_cpus": 3}})  # the CPU engine holds 2 (as in the quickstart)


def step_tests(smoke: Smoke) -> str:
    if not smoke.cuda:
        raise Skip("no CUDA GPU: the gpu-marked tests skip themselves")
    output = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(REPO / "tests")], timeout=1200)
    return output.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------------------------- helpers


def _engine(smoke: Smoke, model_dir: str) -> Any:
    from batchrl.engines import make_engine

    kwargs, env = LAYOUTS[smoke.layout]
    os.environ.update(env)
    if smoke.cuda:
        kwargs = kwargs | {"enforce_eager": False, "gpu_memory_utilization": 0.3, "enable_sleep_mode": True}
    elif smoke.layout == "tp2":  # vllm-cpu binds each worker's threads to a NUMA node unless told which cores
        cores = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in cores[:2]))
    return make_engine("vllm", model_path=model_dir, dtype=smoke.dtype, max_model_len=512, engine_kwargs=kwargs)


def _prompts(smoke: Smoke) -> list[list[int]]:
    from transformers import AutoTokenizer

    from batchrl_toy import arith_problems

    tokenizer = AutoTokenizer.from_pretrained(smoke.model("old", seed=0))
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)["input_ids"]
        for question, _ in arith_problems(num_prompts=32, seed=0)
    ]


def _floors() -> dict[str, str]:
    """The lower bounds pyproject.toml puts on torch, transformers and vllm."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["gpu"]
    floors = {}
    for requirement in requirements:
        name, _, rest = requirement.partition(">=")
        if rest and name.strip().lower() in ("torch", "transformers", "vllm"):
            floors[name.strip().lower()] = rest.split(",")[0].strip()
    return floors


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def _batchrl() -> str:
    return str(Path(sys.executable).parent / "batchrl")


def _run(command: list[str], *, timeout: float) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command[:4])} ... exited {result.returncode}: {result.stderr[-1500:]}")
    return result.stdout


class PeakDeviceMemory:
    """Peak of the GPU's used memory (every process on it) while a step runs, polled every 0.2 s."""

    def __init__(self, cuda: bool):
        self.cuda, self.peak, self._stop = cuda, 0, threading.Event()

    def __enter__(self) -> PeakDeviceMemory:
        if self.cuda:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        import torch

        while not self._stop.wait(0.2):
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()

    def __str__(self) -> str:
        return f"peak GPU {self.peak / 2**30:.1f} GiB" if self.cuda else "no GPU"


def run_steps(smoke: Smoke, steps: list[str], *, say: Callable[[str], None] = print) -> dict[str, str]:
    """Runs the steps in order; returns each one's verdict (PASS, FAIL or SKIP) and says a line per step."""
    verdicts = {}
    for index, name in enumerate(steps):
        started = time.perf_counter()
        with PeakDeviceMemory(smoke.cuda) as memory:
            try:
                verdict, detail = "PASS", globals()[f"step_{name}"](smoke)
            except Skip as why:
                verdict, detail = "SKIP", str(why)
            except Exception as error:  # a failed step is reported and the next one still runs
                verdict, detail = "FAIL", f"{type(error).__name__}: {error}"
                traceback.print_exc(file=sys.stderr)
            finally:
                if smoke.engine is not None and steps[index + 1 : index + 2] != ["push"]:
                    smoke.engine.close()  # nothing else uses it: its workers would hold the cores the next step needs
                    smoke.engine = None
        verdicts[name] = verdict
        say(f"{verdict} {name:<9} {time.perf_counter() - started:7.1f} s  {memory}  {detail}")
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchrl_toy.smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {','.join(STEPS)}")
    parser.add_argument("--size", choices=sorted(SIZES), default="100m", help="the smoke model (default 100m)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="inprocess", help="vLLM engine layout")
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; the steps are {list(STEPS)}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # a screen of vLLM's config per engine otherwise
    import torch

    out = Path(args.out or tempfile.mkdtemp(prefix="batchrl-smoke-"))
    out.mkdir(parents=True, exist_ok=True)
    smoke = Smoke(out=out, size=args.size, layout=args.layout, cuda=torch.cuda.is_available())
    print(
        f"batchrl GPU smoke: {'CUDA ' + torch.cuda.get_device_name(0) if smoke.cuda else 'no GPU (CPU parts)'}, "
        f"model {args.size}, layout {args.layout}, in {out}",
        flush=True,
    )
    verdicts = run_steps(smoke, steps, say=lambda line: print(line, flush=True))
    failed = [name for name, verdict in verdicts.items() if verdict == "FAIL"]
    print("FAIL: " + ", ".join(failed) if failed else "PASS", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # pyarrow 26 may abort at interpreter exit after reading Parquet (see the CLI)
