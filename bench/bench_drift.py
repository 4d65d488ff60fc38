"""Token drift between the engine and the update over multi-turn samples (issue 33): the tokens the update's model
input holds that differ from those the engine produced or was fed, over ~1,000 conversations (target 0).

The conversations run through the real agent loop (batchrl.agents: `generate_conversations`, the calculator tool,
the toy tokenizer encoding the tool turns), then through the tables as a run writes them: rollouts and scores
(conformed to data_schemas, written to and read back from Parquet), the advantage stage's worker (advantages
table, Parquet), and the update's input builder (the index of small columns, the row reader, share_prompt packs
within a token budget, `collate_packs`). For each sample the engine's last input plus its last output is compared
with the prompt and response the update's row holds, token by token; the loss mask with the loop's.

The policy's turns are scripted (the toy model does not write tool calls): each is a run of random token ids, as a
sampler's may be, that the tokenizer would not produce from their decoded text, then a Hermes <tool_call> (or a
final answer and EOS). What re-tokenising the decoded conversation would give instead is printed beside the
result (retokenised_drift_tokens): the drift that storing the exact ids avoids.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

PROMPT_TOKENS = 16
MAX_TURNS = 5


class ScriptedEngine:
    """An engine (batchrl.engines.base.Engine's generate) whose policy turns are scripted from the seed: 0 to 3 calls
    to the calculator, then an answer. It knows a conversation and its turn by the turn's seed (the loop's
    `turn_seed`) and remembers, per conversation, its last input and output."""

    name = "scripted"

    def __init__(self, tokenizer, *, sample_seeds: list[int], seed: int):
        from batchrl.agents.loop import turn_seed

        self.tokenizer, self.rng = tokenizer, random.Random(seed)
        special = set(tokenizer.all_special_ids)
        self.plain_ids = [i for i in range(len(tokenizer)) if i not in special]
        self.turn_of = {turn_seed(s, t): (s, t) for s in sample_seeds for t in range(MAX_TURNS)}
        self.calls_of = {s: self.rng.randint(0, 3) for s in sample_seeds}  # calls each conversation makes
        self.last: dict[int, tuple[list[int], list[int]]] = {}  # sample seed -> (last input, last output)

    def generate(self, prompt_token_ids, *, seeds, sampling):
        from batchrl.engines.base import SampleRecord

        out = []
        for ids, (turn_seed,) in zip(prompt_token_ids, seeds, strict=True):
            key, turn = self.turn_of[turn_seed]
            calls = self.calls_of[key]
            noise = [self.rng.choice(self.plain_ids) for _ in range(self.rng.randint(3, 12))]
            a, b = self.rng.randint(10, 99), self.rng.randint(10, 99)
            if turn < calls:
                call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
                body = f"<tool_call>\n{call}\n"
                token_ids = noise + self.tokenizer.encode(body + "</tool_call>", add_special_tokens=False)
            else:
                body = f" The answer is {a * b}."
                token_ids = noise + self.tokenizer.encode(body, add_special_tokens=False)
                token_ids.append(self.tokenizer.eos_token_id)
            text = self.tokenizer.decode(noise, skip_special_tokens=True) + body  # cut before the stop string
            self.last[key] = (list(ids), token_ids)
            out.append([SampleRecord(token_ids, text, [-1.0 - k / 100 for k in range(len(token_ids))], "stop")])
        return out


def rollouts_table(tokenizer, engine: ScriptedEngine, *, num_groups: int, group_size: int, seed: int) -> pa.Table:
    """The generate stage's rows for ``num_groups`` prompts of ``group_size`` conversations each."""
    from batchrl.agents.columns import generate_conversations
    from batchrl.agents.loop import LoopSettings
    from batchrl.agents.tools import load_tools
    from batchrl.engines.base import SamplingSpec
    from batchrl.storage.schemas import conform

    rng = np.random.default_rng(seed)
    prompts = [rng.choice(engine.plain_ids, PROMPT_TOKENS).tolist() for _ in range(num_groups)]
    columns, _ = generate_conversations(
        engine,
        prompts,
        sample_seeds(num_groups, group_size),
        sampling=SamplingSpec(max_new_tokens=256),
        tools=load_tools(["calculator"]),
        settings=LoopSettings(max_turns=MAX_TURNS, max_response_tokens=4096),
        tokenizer=tokenizer,
    )
    rows = {
        "prompt_id": [f"p{g:04d}" for g in range(num_groups)],
        "data_source": ["drift"] * num_groups,
        "messages_json": ["[]"] * num_groups,
        "prompt_text": [""] * num_groups,
        "prompt_token_ids": prompts,
        "source_file": ["bench"] * num_groups,
        "source_row": list(range(num_groups)),
        "sample_seeds": sample_seeds(num_groups, group_size),
        "policy_version": [0] * num_groups,
    }
    for name in ("ground_truth", "extra_info_json", "logged_responses", "logged_response_token_ids"):
        rows[name] = [None] * num_groups
    for name in ("logged_rewards", "logged_logprobs"):
        rows[name] = [None] * num_groups
    return conform(pa.table(rows | columns), "rollouts")


def sample_seeds(num_groups: int, group_size: int) -> list[list[int]]:
    return [[g * group_size + k for k in range(group_size)] for g in range(num_groups)]


def roundtrip(table: pa.Table, path: Path) -> pa.Table:
    pq.write_table(table, path)
    return pq.read_table(path)


def scored(table: pa.Table, seed: int) -> pa.Table:
    """The score stage's columns: a random 0/1 reward per sample."""
    from batchrl.storage.schemas import conform

    rng = np.random.default_rng(seed)
    sizes = [len(g) for g in table.column("response_token_ids").to_pylist()]
    scores = [rng.integers(0, 2, n).astype(float).tolist() for n in sizes]
    extra = {
        "scores": scores,
        "score_errors": [[None] * n for n in sizes],
        "reward_names": [["toy"]] * len(sizes),
        "reward_weights": [[1.0]] * len(sizes),
        "reward_values": [[[s] for s in group] for group in scores],
    }
    for name, values in extra.items():
        table = table.append_column(name, pa.array(values))
    return conform(table, "scores")


def update_rows(advantages_path: Path, *, max_tokens: int):
    """Per sample (prompt_id, sample_idx): (the ids of its update row's prompt and response, its loss mask)."""
    import torch

    from batchrl.trainer.data import collate_packs
    from batchrl.trainer.forward import pack_plan
    from batchrl.trainer.index import read_index
    from batchrl.trainer.rows import RowReader

    index = read_index([str(advantages_path)])
    rows = RowReader(index, with_rollout_logprobs=True).read(np.arange(index.num_samples))
    out = {}
    for packs in pack_plan(rows, range(rows.num_samples), share_prompt=True, world_size=1, max_tokens=max_tokens)[0]:
        mb = collate_packs(rows, packs, pad_token_id=0, device=torch.device("cpu"))
        s = 0
        for row, pack in enumerate(packs):
            start = len(rows.prompt_token_ids[pack[0]])
            prompt = mb.input_ids_BL[row, :start].tolist()
            for i in pack:
                end = start + len(rows.response_token_ids[i])
                labels = mb.labels_SR[s, : end - start].tolist()
                if labels != mb.input_ids_BL[row, start:end].tolist():  # what the loss scores is the row's ids
                    raise AssertionError(f"sample {i}: labels differ from the row's response ids")
                out[(rows.prompt_ids[i], rows.sample_idx[i])] = (
                    prompt + mb.input_ids_BL[row, start:end].tolist(),
                    mb.response_mask_SR[s, : end - start].tolist(),
                )
                start, s = end, s + 1
    return out, index


def differing(a: list[int], b: list[int]) -> int:
    """Tokens that differ position by position, plus the difference in length."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--group-size", type=int, default=4)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from batchrl.config.models import AdvantageConfig
    from batchrl.stages.advantage import AdvantageWorker
    from batchrl.storage.schemas import conform
    from batchrl_toy import build_toy_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_toy_model(tmp / "toy", hidden_size=64, intermediate_size=128, num_layers=1)
        tokenizer = AutoTokenizer.from_pretrained(tmp / "toy")
        num_groups = args.samples // args.group_size
        seeds = [s for group in sample_seeds(num_groups, args.group_size) for s in group]
        engine = ScriptedEngine(tokenizer, sample_seeds=seeds, seed=0)
        rollouts = roundtrip(
            rollouts_table(tokenizer, engine, num_groups=num_groups, group_size=args.group_size, seed=0),
            tmp / "rollouts.parquet",
        )
        scores = roundtrip(scored(rollouts, seed=1), tmp / "scores.parquet")
        worker = AdvantageWorker(config=AdvantageConfig().model_dump(), moments=None)
        advantages, _ = worker.process(scores)
        pq.write_table(conform(advantages, "advantages"), tmp / "advantages.parquet", row_group_size=128)
        trained, index = update_rows(tmp / "advantages.parquet", max_tokens=4096)

        drift = mask_drift = retokenised = tool_tokens = tokens = 0
        for group in scores.to_pylist():
            for k, (mask, text) in enumerate(zip(group["response_masks"], group["response_texts"])):
                fed, produced = engine.last[group["sample_seeds"][k]]
                ids, loss_mask = trained[(group["prompt_id"], k)]
                drift += differing(fed + produced, ids)  # the engine's last input and output: the whole sample
                mask_drift += sum(bool(m) != lm for m, lm in zip(mask, loss_mask))
                response = group["response_token_ids"][k]
                retokenised += differing(response, tokenizer.encode(text, add_special_tokens=False))
                tool_tokens += len(mask) - sum(mask)
                tokens += len(mask)
    print(f"samples {index.num_samples}, response tokens {tokens}, tool tokens {tool_tokens}")
    print(f"RESULT drift_tokens={drift} (target 0)")
    print(f"RESULT loss_mask_mismatches={mask_drift} (target 0)")
    print(f"RESULT retokenised_drift_tokens={retokenised} (what decoding and re-tokenising would train on)")


if __name__ == "__main__":
    main()
