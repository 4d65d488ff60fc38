"""Helpers of the trainer tests (tests/stages/test_trainer*.py, tests/gpu): synthetic advantages tables, weights
read back from a checkpoint, update specs built from keyword options, and LoRA policies as an update writes them.

Here rather than in test_trainer.py so that tests/gpu can import them too (tests/ is on sys.path: it holds the
root conftest.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from batchrl.config.models import UpdateConfig
from batchrl.trainer import UpdateSpec

ADVANTAGES_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_token_ids", pa.list_(pa.int32())),
        ("response_logprobs", pa.list_(pa.float32())),
        ("advantage", pa.float32()),
    ]
)


def make_spec(**options) -> UpdateSpec:
    """An UpdateSpec from keyword options: UpdateConfig's fields (lr, backend, ...) go into its `update`, validated
    by UpdateConfig; the others (paths, seed, dtype, reference_policy, ...) are the spec's own."""
    update = {name: options.pop(name) for name in list(options) if name in UpdateConfig.model_fields}
    return UpdateSpec(update=UpdateConfig(**update), **options)


def respec(spec: UpdateSpec, **options) -> UpdateSpec:
    """`spec` with `options` changed, sorted between its `update` and its own fields as `make_spec` does."""
    update = {name: options.pop(name) for name in list(options) if name in UpdateConfig.model_fields}
    return dataclasses.replace(spec.with_update(**update) if update else spec, **options)


def tiny_policy_at(out: Path) -> Path:
    """A toy Qwen2 policy small enough for multi-rank trainer tests (hidden 64), built at ``out``."""
    from batchrl_toy import build_toy_model

    build_toy_model(out, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=0)
    return out


def write_lora_policy(base: str, policy: Path, *, seed: int, rank: int = 4) -> Path:
    """policy/ as a LoRA update writes it over `base`: the merged checkpoint, and adapter/ in PEFT's format (`rank`,
    all-linear, B random so that the policy differs from the base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(str(policy / "adapter"))
    model.merge_and_unload().save_pretrained(str(policy))
    AutoTokenizer.from_pretrained(base).save_pretrained(str(policy))
    return policy


def synthetic_rows(*, vocab_size: int, num_prompts: int = 4, samples_per_prompt: int = 4, seed: int = 0):
    """Random prompts/responses with one empty response, in shuffled order (the trainer sorts)."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(num_prompts):
        prompt = rng.integers(3, vocab_size, int(rng.integers(2, 9))).tolist()
        for s in range(samples_per_prompt):
            length = 0 if (p, s) == (1, 2) else int(rng.integers(1, 12))
            rows.append(
                {
                    "prompt_id": f"prompt-{p}",
                    "sample_idx": s,
                    "prompt_token_ids": prompt,
                    "response_token_ids": rng.integers(3, vocab_size, length).tolist(),
                    "response_logprobs": (-5 * rng.random(length)).tolist(),
                    "advantage": float(rng.normal()),
                }
            )
    rng.shuffle(rows)
    return rows


def write_advantages(
    rows: list[dict], out_dir: Path, *, lengths: bool = True, row_group_size: int | None = None
) -> list[str]:
    """Two Parquet parts, like a sharded advantage stage: with the prompt_length and response_length columns it
    writes (`lengths=False`: a table of an earlier batchrl, without them); `row_group_size` rows per row group."""
    out_dir.mkdir(parents=True, exist_ok=True)
    half = len(rows) // 2
    paths = []
    for index, part in enumerate((rows[:half], rows[half:])):
        path = out_dir / f"part-{index:05d}.parquet"
        table = pa.Table.from_pylist(part, schema=ADVANTAGES_SCHEMA)
        if lengths:
            for name, lists in (("prompt_length", "prompt_token_ids"), ("response_length", "response_token_ids")):
                table = table.append_column(name, pc.list_value_length(table.column(lists)).cast(pa.int32()))
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(str(path))
    return paths


def load_weights(policy_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def advantages_manifest(files: list[str]):
    """The manifest an advantage stage commits for these parts."""
    from batchrl.storage.manifest import Manifest, PartInfo
    from batchrl.trainer.integrity import file_sha256

    parts = [
        PartInfo(Path(f).name, pq.read_metadata(f).num_rows, file_sha256(Path(f)), Path(f).stat().st_size)
        for f in files
    ]
    return Manifest(
        stage="advantage",
        table="advantages",
        iteration=0,
        fingerprint="f",
        parts=parts,
        schema="advantages",
        started_at=0.0,
        finished_at=1.0,
    )
