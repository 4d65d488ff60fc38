"""Session fixtures shared by all test suites: the toy model and toy prompts, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchrl_toy import ensure_toy_assets


@pytest.fixture(scope="session")
def toy_assets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding model/ (tiny random Qwen2 + tokenizer) and prompts/ (256 arith prompts, 4 shards)."""
    root = tmp_path_factory.mktemp("toy_assets")
    ensure_toy_assets(root / "model", root / "prompts", num_prompts=256, num_shards=4, seed=0)
    return root


@pytest.fixture(scope="session")
def toy_model_dir(toy_assets_dir: Path) -> str:
    """A float32 Qwen2ForCausalLM (2 layers, hidden 256, vocab ~343) loadable by transformers and vLLM."""
    return str(toy_assets_dir / "model")


@pytest.fixture(scope="session")
def toy_prompts_dir(toy_assets_dir: Path) -> str:
    """batchrl-format arithmetic prompts: part-00000.parquet .. part-00003.parquet, 256 rows in all."""
    return str(toy_assets_dir / "prompts")
