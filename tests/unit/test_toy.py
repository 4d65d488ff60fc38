"""The toy assets must behave like a real small Qwen checkpoint and a real prompt table."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import fsspec
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchrl_toy import (
    BATCHRL_PROMPT_SCHEMA,
    VERL_PROMPT_SCHEMA,
    build_arith_prompts,
    build_toy_model,
    ensure_toy_assets,
    setup_toy_assets,
)

QUESTION = re.compile(r"What is (\d+) ([+-]) (\d+)\? Answer with #### followed by the number\.")


def test_toy_model_loads_with_auto_model_and_predicts_over_the_tokenizer_vocab(toy_model_dir):
    model = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    input_ids = tokenizer(["What is 1 + 2?"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert model.config.model_type == "qwen2"
    assert model.dtype == torch.float32
    assert logits.shape == (1, input_ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def test_every_digit_is_its_own_token_and_text_round_trips(toy_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    for text in ["0123456789", "What is 17 + 25? #### 42", "12 - 7 = 5.\n#### 5", "naïve 😀"]:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    digit_tokens = tokenizer.convert_ids_to_tokens(tokenizer("9876543210")["input_ids"])
    assert digit_tokens == list("9876543210")


def test_special_tokens_are_qwen_style_with_im_end_as_eos(toy_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert len(tokenizer) < 512


def test_chat_template_renders_the_qwen_format_with_a_generation_prompt(toy_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_llama_architecture_builds_and_loads(tmp_path):
    build_toy_model(tmp_path / "llama", arch="llama", seed=1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    assert model.config.model_type == "llama"
    assert model.config.hidden_size // model.config.num_attention_heads == 64


def test_same_seed_builds_the_same_weights_and_another_seed_does_not(tmp_path):
    for name, seed in [("a", 3), ("b", 3), ("c", 4)]:
        build_toy_model(tmp_path / name, seed=seed)
    weights = {n: AutoModelForCausalLM.from_pretrained(tmp_path / n).model.embed_tokens.weight for n in "abc"}
    assert torch.equal(weights["a"], weights["b"])
    assert not torch.equal(weights["a"], weights["c"])


def test_batchrl_prompts_have_the_schema_and_correct_ground_truth(toy_prompts_dir):
    table = ds.dataset(toy_prompts_dir, format="parquet").to_table()
    assert table.schema.equals(BATCHRL_PROMPT_SCHEMA)
    assert table.num_rows == 256
    assert len(set(table["prompt_id"].to_pylist())) == 256
    assert set(table["data_source"].to_pylist()) == {"arith"}
    for prompt, truth in zip(table["prompt"].to_pylist(), table["ground_truth"].to_pylist()):
        a, op, b = QUESTION.fullmatch(prompt).groups()
        assert int(truth) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0


def test_verl_prompts_have_the_verl_schema(tmp_path):
    paths = build_arith_prompts(str(tmp_path), num_prompts=10, num_shards=2, seed=0, fmt="verl")
    table = pq.read_table(paths[1])
    assert table.schema.equals(VERL_PROMPT_SCHEMA)
    row = table.slice(0, 1).to_pylist()[0]
    assert row["prompt"][0]["role"] == "user"
    assert QUESTION.fullmatch(row["prompt"][0]["content"])
    assert row["reward_model"]["style"] == "rule"
    assert row["extra_info"] == {"split": "train", "index": 5}
    assert row["ability"] == "math"


def test_prompts_do_not_depend_on_the_number_of_shards(tmp_path):
    one = build_arith_prompts(str(tmp_path / "one"), num_prompts=50, num_shards=1, seed=7)
    many = build_arith_prompts(str(tmp_path / "many"), num_prompts=50, num_shards=3, seed=7)
    assert [Path(p).name for p in many] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    rows_many = [row for p in many for row in pq.read_table(p).to_pylist()]
    assert pq.read_table(one[0]).to_pylist() == rows_many


def test_prompts_can_be_written_through_an_fsspec_filesystem():
    fs = fsspec.filesystem("memory")
    build_arith_prompts("/toy-bucket/prompts", num_prompts=8, num_shards=2, seed=0, filesystem=fs)
    assert sorted(fs.ls("/toy-bucket/prompts", detail=False)) == [
        "/toy-bucket/prompts/part-00000.parquet",
        "/toy-bucket/prompts/part-00001.parquet",
    ]
    with fs.open("/toy-bucket/prompts/part-00001.parquet", "rb") as f:
        assert pq.read_table(f).num_rows == 4


def test_ensure_toy_assets_builds_once_and_leaves_no_temp_dirs(tmp_path):
    ensure_toy_assets(tmp_path / "m", tmp_path / "d", num_prompts=8, num_shards=2)
    stamp = (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns
    ensure_toy_assets(tmp_path / "m", tmp_path / "d", num_prompts=8, num_shards=2)
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "m"]
    assert ds.dataset(tmp_path / "d", format="parquet").count_rows() == 8


def test_the_setup_step_builds_what_its_arguments_name_and_keeps_a_built_model(tmp_path, toy_model_dir):
    shutil.copytree(toy_model_dir, tmp_path / "m")  # built already: the step keeps it (and the test stays fast)
    stamp = (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns
    setup_toy_assets(
        model_dir=str(tmp_path / "m"),
        data_dir=str(tmp_path / "d"),
        eval_dir=str(tmp_path / "e"),
        format="verl",
        num_prompts=12,
        num_shards=3,
        num_eval_prompts=5,
        max_operand=20,
    )
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns == stamp
    train = ds.dataset(tmp_path / "d", format="parquet").to_table()
    assert train.num_rows == 12 and train.schema.equals(VERL_PROMPT_SCHEMA)
    assert len(list((tmp_path / "d").glob("part-*.parquet"))) == 3
    assert {
        row["extra_info"]["split"] for row in ds.dataset(tmp_path / "e", format="parquet").to_table().to_pylist()
    } == {"test"}


def test_ensure_toy_assets_refuses_to_overwrite_an_incomplete_model_dir(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a complete model"):
        ensure_toy_assets(tmp_path / "m", tmp_path / "d")


_BUILD = """
import hashlib, sys, tempfile
from pathlib import Path
from batchrl_toy import ensure_toy_assets
root = Path(tempfile.mkdtemp())
ensure_toy_assets(root / "model", root / "prompts", num_prompts=8, num_shards=1, sft_steps=3, sft_format_share=0.4)
print(hashlib.sha256((root / "model" / "model.safetensors").read_bytes()).hexdigest())
"""


def _warm_toy_model_digest(**env: str) -> str:
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _BUILD], capture_output=True, text=True, timeout=900, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


@pytest.mark.skipif("avx2" not in Path("/proc/cpuinfo").read_text(), reason="the pinned kernels are AVX2's")
def test_the_sft_warm_toy_model_is_the_same_bits_whatever_kernels_and_threads_the_caller_runs():
    # The caller's torch on its generic (non-SIMD) kernels with 1 thread stands in for another CPU type: before the
    # build pinned its own arithmetic, that alone gave other weights after 3 SFT steps (measured).
    pinned = _warm_toy_model_digest()
    assert _warm_toy_model_digest(ATEN_CPU_CAPABILITY="default", OMP_NUM_THREADS="1") == pinned


def _kernels_available() -> set[str]:
    flags = " ".join(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    return {name for name, flag in (("avx2", "avx2"), ("avx512", "avx512f")) if flag in flags}


def _build_with_kernels(out: Path, kernels: str) -> bytes:
    """The toy build (8 SFT steps) in a child process that runs ATen's `kernels` ("avx2", "avx512"), unpinned."""
    import json
    import os
    import subprocess
    import sys

    args = {"tmp_dir": str(out), "seed": 0, "sft_steps": 8, "sft_format_share": 0.4, "max_operand": 20}
    code = "import sys; from batchrl_toy.assets import build_model_dir_here; build_model_dir_here(sys.argv[1])"
    env = os.environ | {"ATEN_CPU_CAPABILITY": kernels, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, check=True, capture_output=True)
    return (out / "model.safetensors").read_bytes()


@pytest.mark.slow
@pytest.mark.skipif(_kernels_available() != {"avx2", "avx512"}, reason="needs a CPU with AVX-512 (and so AVX2)")
def test_the_toy_build_runs_the_avx2_kernels_on_an_avx512_cpu_so_its_weights_are_an_avx2_cpus(tmp_path, monkeypatch):
    """README: the initial policy is the same bits on every x86-64 CPU with AVX2. On an AVX-512 CPU, ATen's AVX-512
    kernels give other weights than its AVX2 ones after a few SFT steps (the control), and the toy build, asked for
    AVX-512 by its caller's environment, still gives the AVX2 bits (what an AVX2-only CPU computes)."""
    from batchrl_toy.assets import _build_model_dir

    avx2, avx512 = _build_with_kernels(tmp_path / "avx2", "avx2"), _build_with_kernels(tmp_path / "avx512", "avx512")
    assert avx2 != avx512, "ATen's AVX-512 and AVX2 kernels gave the same weights: the control shows nothing"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    _build_model_dir(tmp_path / "pinned", 0, 8, 0.4, 20)
    assert (tmp_path / "pinned" / "model.safetensors").read_bytes() == avx2
    assert '"cpu_capability": "AVX2"' in (tmp_path / "pinned" / "_TOY_MODEL.json").read_text()
