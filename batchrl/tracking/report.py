"""`batchrl report RUN`: PNG plots of a run's metrics per iteration and an HTML page of sample completions.

Everything comes from what the run committed: ``metrics.jsonl`` for the plots (reward, accuracy when an
evaluation wrote val-core/* metrics, KL, entropy, response length, timings) and each iteration's scores
table (through its manifest, never a directory listing) for the samples. Per iteration the page shows the
groups whose scores spread most, the most informative ones: the prompt, the best and the worst response.
Only the first parts of a scores table are read (``SCAN_GROUPS`` groups at least), so the report of a run of
millions of samples stays quick. Local and object-store run directories alike: the report of an s3:// run
is written locally and uploaded to ``<run>/report/`` unless ``out_dir`` says otherwise.
"""

from __future__ import annotations

import html
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

from batchrl.config import ConfigError
from batchrl.storage import RunLayout, is_local, join, read_parquet, resolve, upload_file
from batchrl.storage.manifest import read_manifest
from batchrl.tracking.summary import format_summary
from batchrl.tracking.tables import iteration_dirs

logger = logging.getLogger(__name__)

SCAN_GROUPS = 256  # groups read per iteration to pick the samples shown
MAX_TEXT_CHARS = 4000  # longer prompts and responses are cut in the page


@dataclass(frozen=True)
class Panel:
    """One plot: the metrics drawn as lines (exact names, or prefixes ending in '/'), and an optional band."""

    stem: str
    title: str
    lines: tuple[str, ...]
    band: tuple[str, str] | None = None


PANELS = (
    Panel(
        "reward",
        "Reward (critic/score; band: min..max)",
        ("critic/score/mean", "critic/rewards/"),
        ("critic/score/min", "critic/score/max"),
    ),
    Panel("accuracy", "Held-out accuracy (val-core; iteration -1 = the initial policy)", ("val-core/",)),
    Panel("kl", "KL", ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")),
    Panel("entropy", "Entropy", ("actor/entropy",)),
    Panel(
        "response_length",
        "Response length (tokens; band: min..max)",
        ("response_length/mean",),
        ("response_length/min", "response_length/max"),
    ),
    # with generate.tools: the share of samples that called a tool and the policy's turns per sample (absent without)
    Panel(
        "tools",
        "Tool use (tools/use_rate: share of samples calling; tools/turns_mean)",
        ("tools/use_rate", "tools/turns_mean"),
    ),
    Panel("timings", "Seconds per iteration", ("timing_s/",)),
)


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of ``<run>/metrics.jsonl`` ([] when no iteration has finished)."""
    fs, path = resolve(RunLayout(run_dir).metrics_jsonl)
    try:
        text = fs.cat_file(path).decode()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def write_report(run_dir: str, *, out_dir: str | None = None, groups_per_iteration: int = 3) -> str:
    """Writes ``<out_dir>/index.html`` and its PNG plots (default out_dir: ``<run>/report``); returns the page's
    path or URI. ValueError when ``run_dir`` is not a run directory; ConfigError without matplotlib."""
    layout = RunLayout(run_dir.rstrip("/"))
    fs, run_yaml = resolve(layout.run_yaml)
    if not fs.exists(run_yaml):
        raise ValueError(
            f"{run_dir} has no run.yaml: not a batchrl run directory (give the directory that "
            f"`batchrl run` printed, <run.root>/<run id>)"
        )
    target = out_dir or join(layout.run_dir, "report")
    local = resolve(target)[1] if is_local(target) else tempfile.mkdtemp(prefix="batchrl-report-")
    os.makedirs(local, exist_ok=True)
    try:
        metrics = read_metrics(layout.run_dir)
        plots = plot_metrics(metrics, out_dir=local)
        iterations = run_iterations(layout.run_dir, metrics)
        samples = {i: sample_groups(layout, i, max_groups=groups_per_iteration) for i in iterations}
        page = render_html(layout.run_dir, metrics=metrics, plots=plots, samples=samples)
        with open(os.path.join(local, "index.html"), "w", encoding="utf-8") as f:
            f.write(page)
        if not is_local(target):
            for name in os.listdir(local):
                upload_file(os.path.join(local, name), join(target, name))
    finally:
        if not is_local(target):
            shutil.rmtree(local, ignore_errors=True)
    logger.info("report of %s: %d plot(s), samples of %d iteration(s)", run_dir, len(plots), len(samples))
    return join(target, "index.html") if not is_local(target) else os.path.join(local, "index.html")


def run_iterations(run_dir: str, metrics: list[dict]) -> list[int]:
    """Iterations in metrics.jsonl, and those with an iter_NNNN directory (a run still going)."""
    return sorted(set(iteration_dirs(run_dir)) | {int(m["iteration"]) for m in metrics if "iteration" in m})


def panel_series(panel: Panel, metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metric name -> [(iteration, value)] for the panel's lines that have any value."""
    names = [n for n in panel.lines if not n.endswith("/")]
    prefixes = [n for n in panel.lines if n.endswith("/")]
    for row in metrics:
        names += [k for k in row if any(k.startswith(p) for p in prefixes) and k not in names]
    series = {}
    for name in names:
        points = [
            (int(m["iteration"]), float(m[name]))
            for m in metrics
            if isinstance(m.get(name), (int, float)) and "iteration" in m
        ]
        # The evaluation of the initial policy rides on iteration 0's row as initial/<name>: drawn at -1.
        initial = next((m.get(f"initial/{name}") for m in metrics if m.get("iteration") == 0), None)
        if points and isinstance(initial, (int, float)):
            points.insert(0, (-1, float(initial)))
        if points:
            series[name] = points
    return series


def plot_metrics(metrics: list[dict], *, out_dir: str) -> list[tuple[str, str]]:
    """One PNG per panel that has data; returns [(title, file name)]."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("batchrl report needs matplotlib: pip install 'batchrl[report]'") from None
    written = []
    for panel in PANELS:
        series = panel_series(panel, metrics)
        if not series:
            continue
        fig = Figure(figsize=(7, 3.6), layout="constrained")
        ax = fig.subplots()
        if panel.band is not None:
            low, high = (dict(panel_series(Panel("", "", (k,)), metrics).get(k, [])) for k in panel.band)
            steps = sorted(set(low) & set(high))
            if steps:
                ax.fill_between(steps, [low[s] for s in steps], [high[s] for s in steps], alpha=0.2, label="min..max")
        for name, points in series.items():
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_title(panel.title)
        ax.set_xlabel("iteration")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        name = f"{panel.stem}.png"
        fig.savefig(os.path.join(out_dir, name), dpi=100)
        written.append((panel.title, name))
    return written


@dataclass(frozen=True)
class SampleGroup:
    prompt_id: str
    prompt_text: str
    scores: list[float]
    best: str  # the response with the highest score (the first of equals)
    worst: str  # the response with the lowest score (the first of equals)


def sample_groups(layout: RunLayout, iteration: int, *, max_groups: int) -> list[SampleGroup]:
    """The ``max_groups`` groups of the iteration's scores whose scores spread most (first parts only)."""
    table_dir = layout.table_dir("scores", iteration)
    manifest = read_manifest(table_dir)
    if manifest is None:
        return []
    candidates: list[SampleGroup] = []
    for part in manifest.parts:
        table = read_parquet(
            join(table_dir, part.name), columns=["prompt_id", "prompt_text", "response_texts", "scores"]
        )
        for row in table.to_pylist():
            scores = row["scores"]  # finite: failed samples carry score.failure_reward
            if not scores:
                continue
            best = max(range(len(scores)), key=lambda i: scores[i])
            worst = min(range(len(scores)), key=lambda i: scores[i])
            candidates.append(
                SampleGroup(
                    row["prompt_id"],
                    row["prompt_text"],
                    scores,
                    row["response_texts"][best],
                    row["response_texts"][worst],
                )
            )
        if len(candidates) >= SCAN_GROUPS:
            break
    return sorted(candidates, key=lambda g: -(max(g.scores) - min(g.scores)))[:max_groups]


def render_html(
    run_dir: str, *, metrics: list[dict], plots: list[tuple[str, str]], samples: dict[int, list[SampleGroup]]
) -> str:
    esc = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>batchrl report: {esc(run_dir)}</title>",
        f"<style>{_CSS}</style></head><body><h1>batchrl run {esc(run_dir)}</h1>",
    ]
    summary = format_summary(metrics)
    parts.append(
        f"<h2>Per iteration</h2><pre>{esc(summary)}</pre>"
        if summary
        else "<p>No iteration has finished yet (no metrics.jsonl).</p>"
    )
    parts += [
        f"<figure><img src='{esc(name)}' alt='{esc(title)}'><figcaption>{esc(title)}</figcaption></figure>"
        for title, name in plots
    ]
    parts.append("<h2>Sample completions (groups with the widest score spread; best and worst response)</h2>")
    for iteration, groups in samples.items():
        parts.append(f"<h3>iteration {iteration}</h3>")
        if not groups:
            parts.append("<p>No scores table yet.</p>")
        for group in groups:
            scores = ", ".join(f"{s:.3g}" for s in group.scores)
            parts.append(
                f"<div class='group'><div class='meta'>prompt {esc(group.prompt_id)} &middot; scores [{scores}]</div>"
                f"<pre class='prompt'>{esc(_cut(group.prompt_text))}</pre>"
                f"<div class='label'>best ({max(group.scores):.3g})</div>"
                f"<pre class='best'>{esc(_cut(group.best))}</pre>"
                f"<div class='label'>worst ({min(group.scores):.3g})</div>"
                f"<pre class='worst'>{esc(_cut(group.worst))}</pre></div>"
            )
    parts.append("</body></html>")
    return "\n".join(parts)


def _cut(text: str | None) -> str:
    text = text or ""
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS] + f" ... [{len(text)} characters]"


_CSS = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto} figure{display:inline-block;margin:.5em} "
    "pre{white-space:pre-wrap;background:#f6f6f6;padding:.5em;margin:.2em 0} .group{border-top:1px solid #ccc;"
    "padding:.5em 0} .meta,.label{color:#555;font-size:small} .best{background:#eefbea} .worst{background:#fbeaea}"
)
