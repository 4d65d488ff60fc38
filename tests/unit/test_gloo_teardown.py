"""A rank leaves with its process group destroyed and gloo's threads joined (issue 30).

The abort this prevents, reproduced and read in gdb: a `pt_gloo_runloop` thread finishing an all-reduce releases the
work, whose tensors own their Python objects; releasing one takes the GIL; the interpreter is finalising, so CPython
3.11 ends the thread with pthread_exit, and the forced unwind meets a noexcept destructor (~AsyncWork): std::terminate,
"terminate called without an active exception", SIGABRT. It needs gloo's threads alive during finalisation, which
`dist.destroy_process_group()` alone leaves them once FSDP2 has sharded a model: DTensor keeps the device mesh, and
the mesh keeps the group. See `batchrl.trainer.fsdp.close_process_group`.

Each case runs in a process of its own (one gloo rank, world size 1): a process group is process-wide state.
"""

from __future__ import annotations

import subprocess
import sys

from harness import free_port

_RANK = """
import os, sys
import torch
import torch.distributed as dist
from batchrl.trainer.fsdp import close_process_group, gloo_threads, import_distributed_modules

if sys.argv[2] != "late-import":
    import_distributed_modules()  # as init_distributed does
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
model = torch.nn.Linear(4, 4)
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
optimizer = torch.optim.AdamW(model.parameters())
model(torch.ones(2, 4)).sum().backward()
optimizer.step()  # DTensor ops: DTensor's caches now hold the mesh, and the mesh the group
del model, optimizer
print("before:", gloo_threads())
if sys.argv[2] == "in-flight":  # an all-reduce still running when the rank leaves
    tensor = torch.ones(20_000_000)
    work = dist.all_reduce(tensor, async_op=True)
    del tensor, work
if sys.argv[2] == "destroy-only":
    dist.destroy_process_group()
    print("after:", gloo_threads())
else:
    print("after:", close_process_group())
"""


def _rank(ending: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    result = subprocess.run(
        [sys.executable, "-c", _RANK, str(free_port()), ending], capture_output=True, text=True, timeout=300
    )
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if line.startswith(("before:", "after:")))
    return result, lines


def test_closing_the_group_joins_gloos_threads_that_destroying_it_alone_leaves_running():
    destroyed, destroyed_lines = _rank("destroy-only")
    closed, closed_lines = _rank("close")

    assert destroyed.returncode == 0 and closed.returncode == 0, destroyed.stderr[-2000:] + closed.stderr[-2000:]
    assert "pt_gloo_runloop" in closed_lines["before"]
    assert closed_lines["after"] == "[]"
    # the upstream behaviour the close works around: when this fails, torch destroys the group itself again
    assert destroyed_lines["after"] == destroyed_lines["before"] != "[]"


def test_torch_distributed_modules_imported_after_the_group_exists_keep_it_alive():
    late, lines = _rank("late-import")  # why init_distributed imports them first

    assert late.returncode == 0, late.stderr[-2000:]
    assert "pt_gloo_runloop" in lines["after"]


def test_a_rank_that_leaves_during_an_all_reduce_waits_for_it_and_exits_cleanly():
    result, lines = _rank("in-flight")

    assert result.returncode == 0, result.stderr[-3000:]
    assert lines["after"] == "[]"
    assert "terminate called" not in result.stderr
