"""Toy assets on disk: the model directory (tokenizer, weights, optional SFT warm start) and the prompt
directories, each built once, atomically, and kept; and the pipeline ``setup:`` step that builds them.

Why a setup step and not a part of batchrl: the toy exists for the quickstart and the tests. batchrl only knows
that a pipeline may name functions to call before the run (``setup:``); this package supplies one.

The model is built in a child process with pinned arithmetic (`reproducible_env`), so that the quickstart's
initial policy is the same bits on every x86-64 CPU with AVX2.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batchrl.errors import ConfigError
from batchrl_toy.model import build_toy_model
from batchrl_toy.prompts import build_arith_prompts
from batchrl_toy.sft import sft_warm_start
from batchrl_toy.task import MAX_OPERAND, ArithSplit, ToyTask

logger = logging.getLogger(__name__)

# What a tokenizer/model directory must hold to count as built.
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ToyAssetsConfig(BaseModel):
    """Arguments of the ``batchrl_toy:setup_toy_assets`` setup step: a tiny local model and synthetic arithmetic
    prompts, built if absent (quickstart, tests)."""

    model_config = ConfigDict(extra="forbid")

    model_dir: str = Field(..., description="Where the tiny model is built (if absent); point model.path here.")
    data_dir: str = Field(
        ..., description="Where synthetic prompt shards are built (if absent); point data.train_files here."
    )
    num_prompts: int = Field(64, ge=1, description="Number of synthetic prompts.")
    num_shards: int = Field(2, ge=1, description="Number of prompt Parquet shards written.")
    format: Literal["batchrl", "verl"] = Field("batchrl", description="Column layout of the synthetic prompts.")
    seed: int = Field(0, description="Seed for the model's random init and the prompts.")
    max_operand: int = Field(50, ge=1, description="Operands of the arithmetic prompts are 0..max_operand.")
    sft_steps: int = Field(
        0,
        ge=0,
        description="Supervised warm start of the model when it is built "
        "(batchrl_toy.sft.sft_warm_start: steps of 32 '#### n' demonstrations, never a held-out "
        "question); 0 = random weights, which never earn a reward.",
    )
    sft_format_share: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Share of the SFT demonstrations that end "
        "'#### n'; the others end '#### n.', which the strict gsm8k reward (as verl's) "
        "reads as 'n.' and scores 0, so the warm model has the grader's format to learn.",
    )
    eval_dir: str | None = Field(
        None,
        description="Where held-out prompts are built (if absent); point "
        "evaluate.files here. The training prompts then avoid every held-out question.",
    )
    num_eval_prompts: int = Field(64, ge=1, description="Number of held-out prompts built in eval_dir.")
    task: ToyTask = Field(
        "arith",
        description="arith: a + b and a - b; multiply_tools: a * b (a two-digit, b 2..19), with a tokenizer "
        "that knows the calculator's call (pipelines/tools_quickstart.yaml).",
    )
    sft_tool_share: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of the SFT demonstrations that call the calculator before answering (multiply_tools).",
    )

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> ToyAssetsConfig:
        """The validated arguments, or a ConfigError with one line per mistake, naming the argument
        (``arguments.sft_steps: ...``) as the pipeline file spells it."""
        try:
            return cls.model_validate(dict(arguments))
        except ValidationError as err:
            raise ConfigError("\n".join(cls._problem(e) for e in err.errors())) from None

    @classmethod
    def _problem(cls, error: Any) -> str:
        field = ".".join(["arguments", *(str(p) for p in error["loc"])])
        if error["type"] == "extra_forbidden":
            return f"{field}: unknown argument; batchrl_toy:setup_toy_assets takes {', '.join(cls.model_fields)}"
        if error["type"] == "missing":
            return f"{field}: missing required argument; add it under arguments:"
        got = error.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        return f"{field}: {error['msg'].removeprefix('Value error, ')}{got_text}"


def _model_is_built(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _MODEL_FILES)


def _prompts_are_built(data_dir: Path) -> bool:
    return (data_dir / "_TOY_PROMPTS.json").is_file()


def _build_atomically(target: Path, build: Any) -> None:
    """Run build(tmp_dir) in a sibling temp dir, then rename it to target; a crash leaves no half target.

    If another process renamed its copy first, ours is discarded (both are identical: builds are seeded).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp_dir)
        try:
            os.rename(tmp_dir, target)
        except OSError:
            if not target.exists():
                raise
            logger.info("%s was built concurrently; keeping that copy", target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def ensure_toy_assets(
    model_dir: str | os.PathLike,
    data_dir: str | os.PathLike,
    *,
    num_prompts: int = 256,
    num_shards: int = 4,
    seed: int = 0,
    fmt: Literal["batchrl", "verl"] = "batchrl",
    max_operand: int = MAX_OPERAND,
    sft_steps: int = 0,
    sft_format_share: float = 1.0,
    eval_dir: str | os.PathLike | None = None,
    num_eval_prompts: int = 64,
    task: ToyTask = "arith",
    sft_tool_share: float = 0.0,
) -> None:
    """Build the toy model (with tokenizer) and the arithmetic prompts unless they already exist (local dirs).

    With ``sft_steps`` the model is warm-started by `sft_warm_start` when built (random weights never
    earn a reward), ``sft_format_share`` of its demonstrations in the "#### n" format. With ``eval_dir``,
    held-out prompts are built there (one shard) and the training prompts avoid every held-out question.
    Idempotent: an existing complete directory is kept as is, whatever arguments built it (delete it to
    rebuild with other arguments). A directory that exists but is incomplete (not built by this function)
    is an error rather than silently replaced. ``task`` and ``sft_tool_share``: see `ToyAssetsConfig`.
    """
    tool_task = {} if task == "arith" else {"task": task, "sft_tool_share": sft_tool_share}
    if _claim_dir(Path(model_dir), _model_is_built, "is not a complete model; remove it to rebuild the toy model"):
        _build_atomically(
            Path(model_dir),
            lambda tmp: _build_model_dir(tmp, seed, sft_steps, sft_format_share, max_operand, tool_task),
        )
    train_split: ArithSplit = "all" if eval_dir is None else "train"
    if _claim_dir(Path(data_dir), _prompts_are_built, "holds no toy prompts; remove it to rebuild them"):
        _build_atomically(
            Path(data_dir),
            lambda tmp: _build_prompts_dir(
                tmp, num_prompts, num_shards, seed, fmt, max_operand=max_operand, split=train_split, task=task
            ),
        )
    if eval_dir is not None and _claim_dir(
        Path(eval_dir), _prompts_are_built, "holds no toy prompts; remove it to rebuild them"
    ):
        _build_atomically(
            Path(eval_dir),
            lambda tmp: _build_prompts_dir(
                tmp, num_eval_prompts, 1, seed, fmt, max_operand=max_operand, split="eval", task=task
            ),
        )


def setup_toy_assets(**arguments: Any) -> None:
    """The pipeline ``setup:`` step of the quickstart: `ensure_toy_assets` with arguments validated by
    `ToyAssetsConfig` (a mistake is a ConfigError naming the argument, so `batchrl run` exits 2)::

        setup:
          toy_assets:
            call: batchrl_toy:setup_toy_assets
            arguments: {model_dir: .cache/toy/quickstart/model, data_dir: .cache/toy/quickstart/prompts}
    """
    toy = ToyAssetsConfig.from_arguments(arguments)
    ensure_toy_assets(
        toy.model_dir,
        toy.data_dir,
        num_prompts=toy.num_prompts,
        num_shards=toy.num_shards,
        seed=toy.seed,
        fmt=toy.format,
        max_operand=toy.max_operand,
        sft_steps=toy.sft_steps,
        sft_format_share=toy.sft_format_share,
        eval_dir=toy.eval_dir,
        num_eval_prompts=toy.num_eval_prompts,
        task=toy.task,
        sft_tool_share=toy.sft_tool_share,
    )


def _claim_dir(path: Path, is_built: Any, complaint: str) -> bool:
    """True when `path` must be built: absent or empty (an empty one is removed). ValueError if foreign."""
    if is_built(path):
        return False
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} exists but {complaint}")
    if path.exists():
        path.rmdir()
    return True


# Threads of the toy build. Fixed, so that the SFT's float sums do not depend on the machine's core count.
TOY_BUILD_THREADS = 2


def reproducible_env() -> dict[str, str]:
    """Environment for the process that builds the toy model: the same floats on any x86-64 CPU with AVX2.

    Why: the SFT warm start is 1,200 AdamW steps, and a difference in the last bit of one matmul grows into
    another initial policy (a fresh clone's held-out mean@8 was 0.092 on one machine, 0.148 on another). Its
    arithmetic depends on the kernels torch picks for the CPU: ATen's own (AVX2 or AVX-512 builds of softmax,
    norms, activations) and MKL's GEMMs. ATEN_CPU_CAPABILITY=avx2 and MKL_CBWR=AVX2,STRICT make an AVX-512 CPU
    run the AVX2 code paths, bit for bit, at any thread count. CPUs without AVX2 (and ARM) keep their own kernels.
    """
    env = {"OMP_NUM_THREADS": str(TOY_BUILD_THREADS), "MKL_NUM_THREADS": str(TOY_BUILD_THREADS)}
    if _cpu_has_avx2():
        env |= {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}
    return env


def _cpu_has_avx2() -> bool:
    try:
        return any(line.startswith("flags") and " avx2" in line for line in open("/proc/cpuinfo"))
    except OSError:
        return False


def _build_model_dir(
    tmp_dir: Path,
    seed: int,
    sft_steps: int,
    sft_format_share: float,
    max_operand: int,
    tool_task: dict[str, Any] | None = None,
) -> None:
    """Builds the model in a child process with `reproducible_env` (torch reads it when first imported).
    ``tool_task``: {} for arith (its marker stays as it was), else the task and sft_tool_share."""
    args = json.dumps(
        {
            "tmp_dir": str(tmp_dir),
            "seed": seed,
            "sft_steps": sft_steps,
            "sft_format_share": sft_format_share,
            "max_operand": max_operand,
        }
        | (tool_task or {})
    )
    code = "import sys; from batchrl_toy.assets import build_model_dir_here; build_model_dir_here(sys.argv[1])"
    sys.stderr.flush()  # the child logs to the same stderr, in batchrl's format, as it goes
    done = subprocess.run([sys.executable, "-c", code, args], env={**os.environ, **reproducible_env()})
    if done.returncode != 0:
        raise RuntimeError(
            f"building the toy model in {tmp_dir} failed (exit {done.returncode}); its error is logged above"
        )


def build_model_dir_here(args_json: str) -> None:
    """The toy build, in this process (the child `_build_model_dir` starts): model, SFT, marker file."""
    import torch

    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        datefmt="%H:%M:%S",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(TOY_BUILD_THREADS)
    args = json.loads(args_json)
    tmp_dir, seed, sft_steps = Path(args["tmp_dir"]), args["seed"], args["sft_steps"]
    task = args.get("task", "arith")
    tool_task = {k: args[k] for k in ("task", "sft_tool_share") if k in args}
    build_toy_model(tmp_dir, seed=seed, task=task)
    marker: dict[str, Any] = {
        "seed": seed,
        "sft_steps": sft_steps,
        "sft_format_share": args["sft_format_share"],
        "max_operand": args["max_operand"],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    } | tool_task
    if sft_steps:
        marker |= sft_warm_start(
            tmp_dir,
            num_steps=sft_steps,
            max_operand=args["max_operand"],
            format_share=args["sft_format_share"],
            seed=seed,
            task=task,
            tool_share=args.get("sft_tool_share", 0.0),
        )
    (tmp_dir / "_TOY_MODEL.json").write_text(json.dumps(marker))


def _build_prompts_dir(
    tmp_dir: Path,
    num_prompts: int,
    num_shards: int,
    seed: int,
    fmt: str,
    *,
    max_operand: int = MAX_OPERAND,
    split: ArithSplit = "all",
    task: ToyTask = "arith",
) -> None:
    build_arith_prompts(
        str(tmp_dir),
        num_prompts=num_prompts,
        num_shards=num_shards,
        seed=seed,
        fmt=fmt,
        max_operand=max_operand,
        split=split,
        task=task,
    )
    marker = {
        "num_prompts": num_prompts,
        "num_shards": num_shards,
        "seed": seed,
        "fmt": fmt,
        "max_operand": max_operand,
        "split": split,
    } | ({} if task == "arith" else {"task": task})
    (tmp_dir / "_TOY_PROMPTS.json").write_text(json.dumps(marker))
