"""A native abort in a batchrl process names the Python lines it happened under (issue 30): the update ranks and the
CLI enable faulthandler for every thread, so the next "free(): invalid size" leaves a stack in the rank's crash log
(or the run's output) instead of a bare signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

ABORT_IN_RANK = """
    import sys
    import batchrl.trainer.worker as worker

    def a_function_of_the_rank_that_aborts():
        import os
        os.abort()

    worker.serve = a_function_of_the_rank_that_aborts
    sys.argv = ["worker", "--serve"]
    worker.main()
"""

ABORT_IN_CLI = """
    import batchrl.cli as cli

    def a_command_that_aborts(**kwargs):
        import os
        os.abort()

    cli.app = a_command_that_aborts
    cli.main()
"""


@pytest.mark.parametrize(
    ("program", "function"),
    [(ABORT_IN_RANK, "a_function_of_the_rank_that_aborts"), (ABORT_IN_CLI, "a_command_that_aborts")],
    ids=["update rank", "cli"],
)
def test_a_native_abort_prints_the_python_stack_it_happened_under(program, function):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in done.stderr
    assert function in done.stderr  # the frame the abort happened in
