"""`batchrl report`: a plot per panel that has data, and a page with the best and worst response of the groups
whose scores spread most. The run directory is written by hand (metrics.jsonl, a committed scores table), so
which group and which responses must be shown is known exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from batchrl.storage import write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo, write_manifest
from batchrl.tracking.report import write_report

METRICS = [
    {
        "iteration": 0,
        "critic/score/mean": 0.25,
        "critic/score/min": 0.0,
        "critic/score/max": 1.0,
        "val-core/toy/acc": 0.5,
        "actor/ppo_kl": 0.0,
        "actor/kl_loss": 0.01,
        "response_length/mean": 10.0,
        "response_length/min": 2,
        "response_length/max": 16,
        "timing_s/gen": 3.0,
        "timing_s/step": 5.0,
    },
    {
        "iteration": 1,
        "critic/score/mean": 0.5,
        "critic/score/min": 0.0,
        "critic/score/max": 1.0,
        "val-core/toy/acc": 0.75,
        "actor/ppo_kl": 0.02,
        "actor/kl_loss": 0.02,
        "response_length/mean": 9.0,
        "response_length/min": 1,
        "response_length/max": 16,
        "timing_s/gen": 2.5,
        "timing_s/step": 4.0,
    },
]
GROUPS = [  # prompt_id, prompt_text, responses, scores
    ("p-flat", "What is 2+2?", ["four", "4"], [1.0, 1.0]),  # spread 0: not shown
    ("p-wide", "What is 3*3?", ["nine <b>", "9 <script>x</script>", "ten"], [0.5, 1.0, -1.0]),  # spread 2
    ("p-mid", "What is 1+0?", ["1", "one", "zero"], [1.0, 0.0, 0.5]),  # spread 1
]


def make_run(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "run.yaml").write_text("name: r\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS))
    table = pa.table(
        {
            "prompt_id": [g[0] for g in GROUPS],
            "prompt_text": [g[1] for g in GROUPS],
            "response_texts": [g[2] for g in GROUPS],
            "scores": pa.array([g[3] for g in GROUPS], pa.list_(pa.float32())),
        }
    )
    scores_dir = run_dir / "iter_0000" / "scores"
    num_bytes, digest = write_parquet_atomic(table, str(scores_dir / "part-00000.parquet"))
    write_manifest(
        str(scores_dir),
        Manifest(
            stage="score",
            table="scores",
            iteration=0,
            fingerprint="f",
            parts=[PartInfo("part-00000.parquet", 3, digest, num_bytes)],
            schema="scores",
            started_at=0.0,
            finished_at=1.0,
        ),
    )
    (run_dir / "iter_0001").mkdir()  # iteration 1's scores were not committed (no manifest)


def test_report_plots_each_panel_with_data_and_shows_best_and_worst_of_the_widest_groups(tmp_path):
    import matplotlib.image

    run_dir = tmp_path / "runs" / "r"
    make_run(run_dir)
    page = write_report(str(run_dir), groups_per_iteration=2)

    assert page == str(run_dir / "report" / "index.html")
    pngs = sorted(p.name for p in (run_dir / "report").glob("*.png"))
    assert pngs == ["accuracy.png", "kl.png", "response_length.png", "reward.png", "timings.png"]  # no entropy logged
    for name in pngs:
        height, width, _ = matplotlib.image.imread(run_dir / "report" / name).shape
        assert (width, height) == (700, 360)

    text = Path(page).read_text()
    assert text.index("p-wide") < text.index("p-mid") and "p-flat" not in text  # widest spread first
    wide = text[text.index("p-wide") : text.index("p-mid")]
    assert (
        wide.index("best (1)")
        < wide.index("9 &lt;script&gt;x&lt;/script&gt;")
        < wide.index("worst (-1)")
        < wide.index("ten")
    )  # the best is response 1, the worst response 2, escaped
    assert "<script>" not in text
    assert "iteration 1</h3>\n<p>No scores table yet.</p>" in text
    assert all(f"<img src='{name}'" in text for name in pngs)


def test_report_writes_where_it_is_told_and_refuses_a_directory_that_is_not_a_run(tmp_path):
    run_dir = tmp_path / "r"
    make_run(run_dir)
    out = tmp_path / "elsewhere"
    assert write_report(str(run_dir), out_dir=str(out)) == str(out / "index.html")
    assert (out / "reward.png").exists() and not (run_dir / "report").exists()
    with pytest.raises(ValueError, match="not a batchrl run directory"):
        write_report(str(tmp_path / "elsewhere"))


def test_the_accuracy_panel_starts_at_the_initial_policy_and_skips_iterations_not_evaluated():
    from batchrl.tracking.report import PANELS, panel_series

    metrics = [
        {"iteration": 0, "initial/val-core/arith/reward/mean@1": 0.1, "critic/score/mean": 0.2},
        {"iteration": 1, "val-core/arith/reward/mean@1": 0.4},
        {"iteration": 2, "critic/score/mean": 0.3},
        {"iteration": 3, "val-core/arith/reward/mean@1": 0.6, "actor/reward_kl_penalty": 0.01},
    ]
    accuracy = next(p for p in PANELS if p.stem == "accuracy")
    assert panel_series(accuracy, metrics) == {"val-core/arith/reward/mean@1": [(-1, 0.1), (1, 0.4), (3, 0.6)]}
    kl = next(p for p in PANELS if p.stem == "kl")
    assert panel_series(kl, metrics) == {"actor/reward_kl_penalty": [(3, 0.01)]}


def test_a_run_with_tools_reports_its_tool_use_rate_and_turns_per_sample_over_iterations():
    from batchrl.tracking import format_summary
    from batchrl.tracking.report import PANELS, panel_series

    metrics = [
        {"iteration": 0, "critic/score/mean": 0.2, "tools/use_rate": 0.25, "tools/turns_mean": 1.25},
        {"iteration": 1, "critic/score/mean": 0.6, "tools/use_rate": 0.75, "tools/turns_mean": 1.75},
    ]
    tools = next(p for p in PANELS if p.stem == "tools")
    assert panel_series(tools, metrics) == {
        "tools/use_rate": [(0, 0.25), (1, 0.75)],
        "tools/turns_mean": [(0, 1.25), (1, 1.75)],
    }
    assert format_summary(metrics).splitlines() == [
        "iter  score  tool_use  turns",
        "   0    0.2      0.25   1.25",
        "   1    0.6      0.75   1.75",
    ]
    assert panel_series(tools, METRICS) == {}  # a run without tools draws no tool panel, and its summary has no column
    assert "tool_use" not in format_summary(METRICS)
