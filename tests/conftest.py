"""Session fixtures shared by all test suites: the toy model and toy prompts, built once per session."""

from __future__ import annotations

import contextlib
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


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray of 2 CPUs for one test module, whose workers can import tests/stages (the custom rewards); the
    Ray this process is already connected to when there is one. Engines a test left in the run-wide pool go first."""
    import os

    import ray

    if ray.is_initialized():
        yield
        return
    stages_dir = str(Path(__file__).parent / "stages")
    pythonpath = os.pathsep.join(filter(None, [stages_dir, os.environ.get("PYTHONPATH")]))
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
    )
    try:
        yield
    finally:
        from batchrl.stages.generate import EnginePool

        pool, EnginePool._current = EnginePool._current, None  # a pool of an earlier session is gone with it
        with contextlib.suppress(Exception):
            if pool is not None:
                pool.shutdown()
        ray.shutdown()
