"""Difficulty-aware sampling (data.curriculum) against uniform sampling on the toy, at equal samples (issue 37,
item 5): the share of sample groups with zero advantage (every sample scored alike, so the step learns nothing from
them) and each source's held-out accuracy at the end.

The task and model are the quickstart's: arithmetic "What is a + b?" / "a - b" with operands 0..20 and its SFT-warm
toy model (.cache/toy/quickstart, built by the quickstart's setup step if absent). The two sources are that
arithmetic split by what the warm model does with each question before any RL (the probe, `probe_rates`): the share
of PROBE_SAMPLES samples at temperature 1 that compute the right number, the trailing period ignored. The warm model
writes "#### n." most of the time, which the strict gsm8k grader scores 0 whatever n is: the format is learned in a
few iterations, the arithmetic is what differs from question to question.
- easy (data_source arith): questions the warm model computes in at least EASY_AT_LEAST of its samples; once the
  format is learned their groups pass more and more often in every sample, and a uniform sampler keeps spending
  samples on them.
- hard (data_source arith_hard, scored by the same gsm8k rule through score.reward_by_data_source): questions it
  computes in at most HARD_AT_MOST of its samples: arithmetic still to learn.
Why a split by the model rather than larger operands: the warm model never saw an operand above 20 and computes
almost none of those (a source never solved gives all-fail groups in both arms alike, and nothing to compare).
Each source trains on POOL questions of the train split (PER_ITERATION of them per iteration: every question comes
back every POOL / PER_ITERATION iterations, so the curriculum meets prompts it has seen) and is evaluated on every
question of its difficulty in the held-out bucket (batchrl_toy.task.is_held_out), never trained on, not even by the
warm start.

Groups of 4 samples, not the quickstart's 8: a prompt is skipped once its whole group passed, and this model's pass
rate on an easy question after the format is learned is ~0.7 per sample, so a group of 8 passes whole ~6% of the
time (0.7^8) and one of 4 ~24%. Measured with 8 per source of 32 per iteration, 8 samples, 20 iterations: 5% of
all groups passed whole, the curriculum skipped 15 prompts in a run, and the two arms were nearly the same runs
(ratio 0.97). So the prompts per iteration are doubled (16 per source, from pools of 48) to keep 128 samples an
iteration, and the optimizer steps per iteration stay the quickstart's 4.

Both arms run `batchrl run pipelines/quickstart.yaml` with the same overrides (the two sources with a count each,
the same seed, iterations, samples per prompt and optimizer steps per iteration); the curriculum arm adds
data.curriculum {skip_solved_streak, revisit}. Each arm runs with every seed of SEEDS, and the figures are means over
seeds. Zero-advantage share = sum over iterations of data/zero_advantage_groups / sum of prompts (groups) rolled out,
from each run's metrics.jsonl; the scores tables split it into all-pass and all-fail groups (the curriculum can skip
only the first: a prompt never solved has no solved streak). Held-out accuracy: val-core/<data_source>/reward/mean@1
(greedy) and mean@EVAL_SAMPLES (sampled) of the evaluation after the last iteration.

Targets (issue 37): zero-advantage share curriculum / uniform <= 0.7, held-out accuracy curriculum - uniform >= 0 for
each source. Figures are printed whatever they are; a target not reached says `missed`. Held-out sets are small
(a few dozen questions each: one question is several points of greedy accuracy), and one seed's greedy accuracy moves
by 10 points with the arithmetic alone (bench_overlap): read the held-out differences with that in mind. The figures
of a side run and why the ratio is what it is: README, 'Mixing data sources'. ~8 min on 2 cores (4 runs of ~2 min,
the probe ~30 s), so opt-in in run_all.py; `--iterations 3 --seeds 0` for a quick look.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness.py
from harness import REPO, cli_ok, read_metrics, read_table

PIPELINE = "pipelines/quickstart.yaml"
ITERATIONS = 20
SEEDS = (0, 1)
POOL = 48  # training prompts per source
PER_ITERATION = 16  # prompts of each source per iteration: each prompt comes back every POOL / PER_ITERATION iterations
SAMPLES_PER_PROMPT = 4  # the group size (the quickstart samples 8)
SKIP_SOLVED_STREAK = 1
REVISIT = 0.05
PROBE_SAMPLES = 16
EASY_AT_LEAST = 0.5
HARD_AT_MOST = 0.125
EVAL_SAMPLES = 16
PASS_THRESHOLD = 0.5  # data.pass_threshold's default: a sample passes when its score is above it
SOURCES = {"easy": "arith", "hard": "arith_hard"}  # source name -> its data_source (reward and held-out metrics)
ARMS = ("uniform", "curriculum")
OUTCOMES = ("all_pass", "all_fail", "mixed")  # how a group's samples scored (group_outcomes)


def computed_right(response: str, answer: str) -> bool:
    """Whether a response's "#### n" holds the right number, a trailing period allowed (the strict grader's
    extraction, which reads "#### 7." as "7.", with that period dropped)."""
    from batchrl.rewards.gsm8k import extract_gsm8k_answer

    extracted = extract_gsm8k_answer(response, method="strict")
    return extracted is not None and extracted.rstrip(".") == answer


def probe_rates(model_dir: str, problems: list[tuple[str, str]], *, num_samples: int, seed: int) -> list[float]:
    """Per (question, answer): the share of ``num_samples`` samples of the model (temperature 1, the chat template
    as ingest applies it, at most the quickstart's 12 new tokens) that compute the right number. One thread and a
    fixed seed: the same rates on every run on a machine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rates: list[float] = []
    chunk = 64
    for start in range(0, len(problems), chunk):
        batch = problems[start : start + chunk]
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q, _ in batch
        ]
        encoded = tokenizer(texts, return_tensors="pt", padding=True)
        torch.manual_seed(seed + start)
        with torch.no_grad():
            out_SL = model.generate(  # [len(batch) x num_samples, prompt + new tokens]
                **encoded,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                max_new_tokens=12,
                num_return_sequences=num_samples,
                pad_token_id=tokenizer.pad_token_id,
            )
        responses = tokenizer.batch_decode(out_SL[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
        for index, (_, answer) in enumerate(batch):
            samples = responses[index * num_samples : (index + 1) * num_samples]
            rates.append(sum(computed_right(r, answer) for r in samples) / num_samples)
    return rates


def split_by_difficulty(
    problems: list[tuple[str, str]], rates: list[float], *, easy_at_least: float, hard_at_most: float
) -> dict[str, list[tuple[str, str]]]:
    """The problems the probe found easy (rate >= easy_at_least) and hard (rate <= hard_at_most), in the order
    given; those in between are in neither."""
    if hard_at_most >= easy_at_least:
        raise ValueError(f"hard_at_most={hard_at_most} must be below easy_at_least={easy_at_least}")
    return {
        "easy": [p for p, rate in zip(problems, rates) if rate >= easy_at_least],
        "hard": [p for p, rate in zip(problems, rates) if rate <= hard_at_most],
    }


def write_prompts(out_dir: Path, problems: list[tuple[str, str]], *, prefix: str, data_source: str) -> str:
    """One Parquet file of prompts in batchrl's layout (prompt ids ``prefix``-NNNNNN); returns the directory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchrl_toy import BATCHRL_PROMPT_SCHEMA

    columns = {
        "prompt_id": [f"{prefix}-{i:06d}" for i in range(len(problems))],
        "data_source": [data_source] * len(problems),
        "prompt": [q for q, _ in problems],
        "ground_truth": [a for _, a in problems],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pydict(columns, schema=BATCHRL_PROMPT_SCHEMA), out_dir / "part-00000.parquet")
    return str(out_dir)


def build_sources(work: Path, model_dir: str, *, pool: int) -> tuple[dict[str, dict], dict[str, float]]:
    """Writes each source's training and held-out prompts under ``work``; returns {source: {train, eval, counts,
    probe rate}} and the probe's figures."""
    import numpy as np

    from batchrl_toy import all_arith_problems, is_held_out

    max_operand = 20  # the quickstart's (pipelines/quickstart.yaml, setup.toy_assets.arguments.max_operand)
    problems = all_arith_problems(max_operand=max_operand)
    started = time.perf_counter()
    rates = probe_rates(model_dir, problems, num_samples=PROBE_SAMPLES, seed=0)
    probe = {"seconds": time.perf_counter() - started, "mean_rate": float(np.mean(rates)), "problems": len(problems)}
    rate_of = dict(zip(problems, rates))
    sources = {}
    for held_out in (False, True):
        chosen = [(p, r) for p, r in zip(problems, rates) if is_held_out(p[0]) == held_out]
        split = split_by_difficulty(
            [p for p, _ in chosen], [r for _, r in chosen], easy_at_least=EASY_AT_LEAST, hard_at_most=HARD_AT_MOST
        )
        for name, data_source in SOURCES.items():
            found = split[name]
            if not held_out:
                if len(found) < pool:
                    raise SystemExit(f"the probe found {len(found)} {name} training questions, fewer than {pool}")
                order = np.random.default_rng(0).permutation(len(found))  # a fixed draw: the same pools every seed
                found = [found[i] for i in sorted(order[:pool].tolist())]
            kind = "eval" if held_out else "train"
            entry = sources.setdefault(name, {})
            entry[kind] = write_prompts(work / name / kind, found, prefix=f"{name}-{kind}", data_source=data_source)
            entry[f"{kind}_count"] = len(found)
            entry[f"{kind}_probe_rate"] = float(np.mean([rate_of[p] for p in found])) if found else float("nan")
    return sources, probe


def arm_overrides(arm: str, *, root: Path, seed: int, iterations: int, sources: dict[str, dict]) -> list[str]:
    """The `--set` overrides of one arm of the comparison on the quickstart pipeline."""
    listed = ", ".join(
        f"{{name: {name}, files: [{entry['train']}], count: {PER_ITERATION}}}" for name, entry in sources.items()
    )
    sets = [
        f"run.root={root}",
        f"run.seed={seed}",
        f"run.iterations={iterations}",
        f"generate.num_samples_per_prompt={SAMPLES_PER_PROMPT}",
        "data.train_files=null",
        f"data.sources=[{listed}]",
        # one shard per iteration, as the quickstart (its ray: comment says why)
        f"data.shard_size={PER_ITERATION * len(sources)}",
        # 4 optimizer steps per iteration, as the quickstart's 32 of its 128 prompts
        f"update.ppo_mini_batch_size={PER_ITERATION * len(sources) // 4}",
        f"score.reward_by_data_source={{{SOURCES['hard']}: gsm8k}}",
        f"evaluate.files=[{', '.join(entry['eval'] for entry in sources.values())}]",
        f"evaluate.num_samples={EVAL_SAMPLES}",
        f"evaluate.every={iterations}",  # before training and after the last iteration only
    ]
    if arm == "curriculum":
        sets.append(f"data.curriculum={{skip_solved_streak: {SKIP_SOLVED_STREAK}, revisit: {REVISIT}}}")
    return sets


def run_arm(arm: str, *, root: Path, seed: int, iterations: int, sources: dict[str, dict]) -> dict:
    """One `batchrl run`, and what the comparison reads from it: its metrics.jsonl lines, its groups by how they
    scored (from each iteration's scores table), its wall seconds."""
    run_id = f"{arm}-seed{seed}"
    sets = arm_overrides(arm, root=root, seed=seed, iterations=iterations, sources=sources)
    started = time.perf_counter()
    cli_ok("run", PIPELINE, "--run-id", run_id, sets=sets, timeout=None)
    wall = time.perf_counter() - started
    run_dir = root / run_id
    groups = [
        group_outcomes(read_table(run_dir / f"iter_{i:04d}" / "scores").select(["source", "scores"]).to_pylist())
        for i in range(iterations)
    ]
    return {"metrics": read_metrics(run_dir), "groups": groups, "wall": wall}


def group_outcomes(rows: list[dict]) -> dict[str, int]:
    """Counts of one iteration's groups (one row per prompt with its ``scores``; its ``source``) by source and
    outcome: all_pass (every sample above PASS_THRESHOLD), all_fail, or mixed; zero-advantage groups are those whose
    scores are all equal (all_pass and all_fail ones with binary rewards)."""
    counts: dict[str, int] = {}
    for row in rows:
        passed = [score > PASS_THRESHOLD for score in row["scores"]]
        outcome = "all_pass" if all(passed) else "all_fail" if not any(passed) else "mixed"
        for key in (outcome, f"{outcome}/{row['source']}"):
            counts[key] = counts.get(key, 0) + 1
    return counts


def zero_advantage_share(metrics: list[dict], *, source: str | None = None) -> float:
    """Sum over iterations of data/zero_advantage_groups over the groups (prompts) rolled out, of all sources or of
    one (the /<source> metrics)."""
    suffix = "" if source is None else f"/{source}"
    zero = sum(m.get(f"data/zero_advantage_groups{suffix}", 0.0) for m in metrics)
    if source is None:
        groups = sum(m["data/prompts"] for m in metrics)
    else:
        groups = sum(m[f"data/prompts/{source}"] for m in metrics)
    return zero / groups


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def met(ok: bool) -> str:
    return "met" if ok else "missed"


def report(runs: dict[tuple[str, int], dict], *, seeds: tuple[int, ...], iterations: int, sources: dict) -> None:
    """The RESULT lines, from the runs of both arms and every seed."""
    share = {arm: mean([zero_advantage_share(runs[(arm, s)]["metrics"]) for s in seeds]) for arm in ARMS}
    for arm in ARMS:
        samples = [sum(m["perf/num_samples"] for m in runs[(arm, s)]["metrics"]) for s in seeds]
        groups = sum(g.get(o, 0) for s in seeds for g in runs[(arm, s)]["groups"] for o in OUTCOMES)
        outcomes = {
            o: sum(g.get(o, 0) for s in seeds for g in runs[(arm, s)]["groups"]) / groups
            for o in ("all_pass", "all_fail")
        }
        per_source = ", ".join(
            f"{name} {mean([zero_advantage_share(runs[(arm, s)]['metrics'], source=name) for s in seeds]):.3f}"
            for name in sources
        )
        skipped = mean([sum(m.get("data/curriculum_skipped", 0) for m in runs[(arm, s)]["metrics"]) for s in seeds])
        print(
            f"RESULT {arm}_zero_advantage_share={share[arm]:.3f} (of all groups over {iterations} iterations, mean "
            f"of seeds {list(seeds)}; all-pass {outcomes['all_pass']:.3f}, all-fail {outcomes['all_fail']:.3f}; by "
            f"source: {per_source}; {int(mean(samples))} samples per run, {skipped:.0f} solved prompts skipped)"
        )
    ratio = share["curriculum"] / share["uniform"] if share["uniform"] else float("nan")  # nan: no group to spare
    print(
        f"RESULT curriculum_over_uniform_zero_advantage_share={ratio:.2f} (target <= 0.7, {met(ratio <= 0.7)}; "
        f"{share['curriculum']:.3f} / {share['uniform']:.3f}, at equal samples)"
    )
    for name, data_source in SOURCES.items():
        for kind, metric in (("greedy", "mean@1"), ("sampled", f"mean@{EVAL_SAMPLES}")):
            key = f"val-core/{data_source}/reward/{metric}"
            final = {arm: [runs[(arm, s)]["metrics"][-1][key] for s in seeds] for arm in ARMS}
            initial = runs[("uniform", seeds[0])]["metrics"][0][f"initial/{key}"]
            points = 100 * (mean(final["curriculum"]) - mean(final["uniform"]))
            per_seed = ", ".join(
                f"seed {s}: {u:.3f} -> {c:.3f}" for s, u, c in zip(seeds, final["uniform"], final["curriculum"])
            )
            print(
                f"RESULT heldout_{name}_{kind}_points_curriculum_minus_uniform={points:+.1f} (target >= 0, "
                f"{met(points >= 0)}; {key} on {sources[name]['eval_count']} held-out questions after {iterations} "
                f"iterations: uniform {mean(final['uniform']):.3f}, curriculum {mean(final['curriculum']):.3f}, "
                f"initial {initial:.3f}; uniform -> curriculum {per_seed})"
            )


def conditions_line(*, seeds: tuple[int, ...], iterations: int, sources: dict, probe: dict, walls: list[float]) -> str:
    source_words = "; ".join(
        f"{name} ({SOURCES[name]}): {entry['train_count']} training questions (warm-model rate "
        f"{entry['train_probe_rate']:.2f}), {entry['eval_count']} held-out ({entry['eval_probe_rate']:.2f})"
        for name, entry in sources.items()
    )
    return (
        f"RESULT conditions={iterations}x{PER_ITERATION * len(sources)}x{SAMPLES_PER_PROMPT} (iterations x prompts x "
        f"samples per prompt, {PER_ITERATION} per source, the same for both arms and seeds {list(seeds)}; "
        f"{source_words}; sources split by the warm model's rate of right numbers in {PROBE_SAMPLES} samples "
        f"(easy >= {EASY_AT_LEAST}, hard <= {HARD_AT_MOST}; {probe['problems']} questions, mean rate "
        f"{probe['mean_rate']:.2f}); curriculum: skip_solved_streak {SKIP_SOLVED_STREAK}, revisit {REVISIT}; "
        f"{len(walls)} runs, {mean(walls):.0f} s each)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--pool", type=int, default=POOL, help="training questions per source")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (prompts and runs)")
    args = parser.parse_args()
    from batchrl.config import load_pipeline
    from batchrl.setup_steps import run_setup_steps

    cfg = load_pipeline(REPO / PIPELINE)
    run_setup_steps(cfg.setup)  # the quickstart's warm model, built if absent (paths relative to the repository)
    work = Path(tempfile.mkdtemp(prefix="bench-curriculum-"))
    try:
        sources, probe = build_sources(work, str(REPO / cfg.model.path), pool=args.pool)
        seeds = tuple(args.seeds)
        runs = {
            (arm, seed): run_arm(arm, root=work / "runs", seed=seed, iterations=args.iterations, sources=sources)
            for seed in seeds
            for arm in ARMS
        }
        report(runs, seeds=seeds, iterations=args.iterations, sources=sources)
        walls = [run["wall"] for run in runs.values()]
        print(conditions_line(seeds=seeds, iterations=args.iterations, sources=sources, probe=probe, walls=walls))
        print(f"# probe {probe['seconds']:.0f} s; all-pass/all-fail groups of {PER_ITERATION} per source by iteration:")
        for (arm, seed), run in runs.items():
            cells = " ".join(
                "|".join(f"{g.get(f'all_pass/{n}', 0)}/{g.get(f'all_fail/{n}', 0)}" for n in sources)
                for g in run["groups"]
            )
            print(f"# {arm} seed {seed} ({'|'.join(sources)}): {cells}")
    finally:
        if args.keep:
            print(f"# work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
