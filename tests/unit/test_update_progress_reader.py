"""The update's progress channel without a real update: rank 0's JSON-lines writer, the launcher's reader (torn
lines, garbage, a file that is not there yet), the guard that keeps a broken display from failing the update,
and the bar the update stage draws from the records."""

from __future__ import annotations

import io
import json

from rich.console import Console

from batchrl.stages.update import _progress_display
from batchrl.tracking.progress import progress
from batchrl.trainer.launch import _progress_poller, _wait_for_workers
from batchrl.trainer.progress_file import ProgressReader, ProgressWriter, parse_progress


def _line(record: dict) -> bytes:
    return (json.dumps(record) + "\n").encode()


def test_parse_keeps_a_torn_last_line_for_the_next_read_and_skips_garbage():
    whole = _line({"phase": "train", "done": 0, "total": 3}) + b"not json\n" + b"[1, 2]\n"
    torn = _line({"phase": "train", "done": 1, "total": 3})[:12]
    records, tail = parse_progress(whole + torn)
    assert records == [{"phase": "train", "done": 0, "total": 3}]
    assert tail == torn
    assert parse_progress(b"") == ([], b"")


def test_reader_turns_a_growing_file_with_a_torn_line_into_step_counts(tmp_path):
    path = tmp_path / "progress.jsonl"
    reader = ProgressReader(path)
    assert reader.poll() == []  # rank 0 has not started writing yet

    steps = [_line({"phase": "train", "done": k, "total": 3, "pg_loss": -0.1 * k, "grad_norm": 1.0}) for k in range(4)]
    with open(path, "ab") as f:
        f.write(_line({"phase": "logprobs"}) + steps[0] + steps[1] + steps[2][:7])  # caught mid-write
    first = reader.poll()
    assert [r.get("done") for r in first] == [None, 0, 1]
    with open(path, "ab") as f:
        f.write(steps[2][7:] + steps[3] + _line({"phase": "save"}))
    second = reader.poll()
    assert [r.get("done") for r in second] == [2, 3, None] and second[0]["pg_loss"] == -0.2
    assert reader.poll() == []  # nothing new


def test_writer_appends_flushed_lines_and_never_raises(tmp_path):
    path = tmp_path / "progress.jsonl"
    writer = ProgressWriter(path)
    writer.write({"phase": "train", "done": 1, "total": 2})
    assert ProgressReader(path).poll() == [{"phase": "train", "done": 1, "total": 2}]  # readable before close
    writer.close()

    ProgressWriter(None).write({"phase": "save"})  # other ranks: a no-op
    broken = ProgressWriter(tmp_path / "missing-dir" / "progress.jsonl")
    broken.write({"phase": "save"})  # a warning, not an error
    broken.write({"phase": "save"})


def test_a_display_that_raises_is_switched_off_not_propagated(tmp_path, caplog):
    path = tmp_path / "progress.jsonl"
    path.write_bytes(b"".join(_line({"phase": "train", "done": k, "total": 2}) for k in range(2)))
    calls = []

    def display(record):
        calls.append(record)
        raise RuntimeError("terminal went away")

    poll = _progress_poller(ProgressReader(path), display)
    poll()
    poll()
    assert len(calls) == 1 and "progress display off" in caplog.text


class _Running:
    """A rank that never exits (poll() is None) until `exits_after` polls, then exits 0."""

    def __init__(self, exits_after: int | None = None):
        self.polls, self.exits_after, self.returncode = 0, exits_after, None

    def poll(self):
        self.polls += 1
        if self.exits_after is not None and self.polls > self.exits_after:
            self.returncode = 0
        return self.returncode


def test_the_launcher_reads_progress_on_every_poll_and_still_honours_its_timeout(tmp_path):
    stderr = tmp_path / "rank0.err"
    stderr.write_text("still loading\n")
    polls = []
    hung = [{"rank": 0, "process": _Running(), "stderr_path": stderr}]
    failure = _wait_for_workers(hung, timeout_s=0.3, on_poll=lambda: polls.append(1))
    assert "timed out after 0.3 s" in failure and "still loading" in failure and len(polls) >= 2

    polls.clear()
    finishing = [{"rank": 0, "process": _Running(exits_after=2), "stderr_path": stderr}]
    assert _wait_for_workers(finishing, timeout_s=10, on_poll=lambda: polls.append(1)) is None
    assert len(polls) == 3


def test_the_stage_draws_steps_with_the_latest_losses_on_a_terminal_only():
    records = [{"phase": "logprobs"}, {"phase": "train", "done": 0, "total": 4}]
    records += [
        {"phase": "train", "done": k, "total": 4, "pg_loss": 0.01 * k, "grad_norm": 0.5 + k} for k in range(1, 5)
    ]
    records += [{"phase": "save"}, {"phase": "finished"}]
    terminal = io.StringIO()
    with progress(None, "update: loading", console=Console(file=terminal, force_terminal=True, width=120)) as bar:
        show = _progress_display(bar)
        for record in records:
            show(record)
    assert (bar.completed, bar.total) == (4, 4)
    final = terminal.getvalue().rsplit("\r", 1)[-1]
    assert "4/4" in final and "pg_loss 0.04" in final and "grad_norm 4.5" in final

    with progress(None, "update: loading", console=Console(file=io.StringIO(), force_terminal=False)) as bar:
        assert not bar.drawn
