"""Which local paths every node of a Ray cluster sees as the driver does.

Why: on a cluster of several nodes, actors on other nodes read and write the run directory. Object storage
(s3://...) is the same everywhere; a local path is only if it is a filesystem mounted at that path on every node
(NFS, a shared volume). Each node is asked, by a zero-CPU task pinned to it:
- for a directory the run writes into: to read a marker file the driver has just written there (a node-local
  directory of the same name would not have it);
- for an input it only reads (a model directory, possibly read-only): to list the same files with the same sizes
  (a copy at the same path on every node is as good as a shared mount for reading).
On one node (the embedded Ray, or a one-node cluster) nothing is asked.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

PROBE_TIMEOUT_S = 60.0
MAX_LISTED_FILES = 10_000  # an input directory's listing is compared up to this many files
MARKER_PREFIX = ".batchrl-shared-probe-"

# (paths to write into, paths to read) -> {path: [IPs of nodes that do not see it as the driver does]}
Probe = Callable[[Iterable[str], Iterable[str]], dict[str, list[str]]]


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [node for node in ray.nodes() if node["Alive"]]


def unshared_paths(writes: Iterable[str], reads: Iterable[str]) -> dict[str, list[str]]:
    """{path: IPs of the alive nodes where it is not what the driver sees}, for local paths only; {} on one node.

    `writes`: paths the run writes (created if missing, as their first existing ancestor is probed); `reads`:
    existing files or directories it only reads."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = alive_nodes()
    writes, reads = sorted(set(writes)), sorted(set(reads))
    if len(nodes) <= 1 or not (writes or reads):
        return {}
    markers, expected = {}, {}
    try:
        for path in writes:
            directory = _existing_ancestor(Path(path))
            marker = directory / f"{MARKER_PREFIX}{uuid.uuid4().hex}"
            marker.write_text(marker.name)
            markers[path], expected[path] = marker, ("marker", str(marker), marker.name)
        for path in reads:
            expected[path] = ("listing", path, _listing(path))
        probe = ray.remote(num_cpus=0, max_retries=0)(_observe)
        targets = [(kind, target) for kind, target, _ in expected.values()]
        refs = [
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
                targets
            )
            for node in nodes
        ]
        seen = list(zip((node["NodeManagerAddress"] for node in nodes), ray.get(refs, timeout=PROBE_TIMEOUT_S)))
    finally:
        for marker in markers.values():
            marker.unlink(missing_ok=True)
    return {
        path: sorted({ip for ip, observed in seen if observed[index] != want})
        for index, (path, (_, _, want)) in enumerate(expected.items())
        if any(observed[index] != want for _, observed in seen)
    }


def _existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    return path if path.is_dir() else path.parent


def _listing(path: str) -> Any:
    """A file's size, or a directory's (relative path, size) pairs, sorted; None if missing."""
    base = Path(path)
    if base.is_file():
        return base.stat().st_size
    if not base.is_dir():
        return None
    files = []
    for root, _, names in os.walk(base):
        for name in names:
            full = Path(root) / name
            try:
                files.append((full.relative_to(base).as_posix(), full.stat().st_size))
            except OSError:
                continue
            if len(files) >= MAX_LISTED_FILES:
                return sorted(files)
    return sorted(files)


def _observe(targets: list[tuple[str, str]]) -> list[Any]:
    """On one node: a marker's content (None if unreadable), or a read path's listing."""
    observed = []
    for kind, target in targets:
        if kind == "marker":
            try:
                observed.append(Path(target).read_text())
            except OSError:
                observed.append(None)
        else:
            observed.append(_listing(target))
    return observed


def describe(unshared: dict[str, list[str]], names: dict[str, str]) -> str:
    """ "field=path (not the same on node 10.0.0.2)" per unshared path; `names`: path -> the config field naming it."""
    return ", ".join(
        f"{names.get(path, path)}={path} (not the same on node {', '.join(ips)})" for path, ips in unshared.items()
    )
