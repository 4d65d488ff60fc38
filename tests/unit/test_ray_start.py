"""Ray that does not start (issue 30's soak met "The current node timed out during startup" on an overloaded
machine) stops a run with one line and exit 4, the transient failures' code a scheduler retries, before any stage
ran; not a traceback and exit 1."""

from __future__ import annotations

from harness import cli, write_pipeline

FAILING_RAY = """
import ray

def _init(*args, **kwargs):
    raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")

ray.init = _init
"""


def test_a_ray_that_does_not_start_stops_the_run_with_one_line_and_exit_4(tmp_path, toy_model_dir, toy_prompts_dir):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAILING_RAY)  # in the CLI's process only: Ray never starts
    path = write_pipeline(tmp_path, {"name": "nostart"}, model=toy_model_dir, prompts=toy_prompts_dir)

    result = cli("run", path, path_first=[hook])

    assert result.returncode == 4, result.stderr[-3000:]
    assert "interrupted: the embedded Ray did not start (Exception: The current node timed out" in result.stderr
    assert "nothing was run: run the same command again" in result.stderr
    assert "Traceback" not in result.stderr
    run_dir = tmp_path / "runs" / "nostart"
    assert not (run_dir / "prompts" / "_MANIFEST.json").exists()
    assert "lock: free" in cli("status", run_dir).stdout
