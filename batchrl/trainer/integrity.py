"""Checksums of an optimizer state before it is loaded, because loading it runs code from the files.

torch.distributed.checkpoint reads `optimizer/.metadata` with `pickle.load` and its byte items with
`torch.load(weights_only=False)`: whoever can write a trainer-state directory could run code in the trainer
ranks. So the update that saves a state records each file's sha256 in its policy manifest
(`Manifest.trainer_state`), the next update passes them on in `UpdateSpec.trainer_state_sha256`, and a rank
loads nothing unless every recorded file hashes as recorded (`worker.verified_trainer_state`; Ray actors also
check the copy they download, `ray_launch.stage_inputs`). A mismatch is a `TrainerStateError` naming the file;
the launchers hand it back to the update stage as such, which reports it as a data error.

Torch-free, so that the driver and the launchers can import it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

ERROR_SUFFIX = ".trainer_state_error.json"  # beside the spec's metrics file: how a local rank reports a mismatch


class TrainerStateError(ValueError):
    """A trainer-state file is missing or is not the file its writer recorded; nothing was loaded from it."""

    def __init__(self, name: str, reason: str):
        super().__init__(name, reason)  # the args rebuild it when Ray pickles it back to the driver
        self.name, self.reason = name, reason

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_digests(expected: dict[str, str], actual: dict[str, str]) -> None:
    """Raises TrainerStateError for the first recorded file (by name) that is missing from ``actual`` or hashes
    differently. Files that are not recorded are not checked: DCP reads only the shards its (checked) metadata
    names."""
    for name in sorted(expected):
        if name not in actual:
            raise TrainerStateError(name, "missing")
        if actual[name] != expected[name]:
            raise TrainerStateError(
                name,
                f"sha256 {actual[name][:16]}... is not the {expected[name][:16]}... "
                "recorded when it was written (modified or corrupted since)",
            )


def verify_dir(root: str | Path, expected: dict[str, str]) -> None:
    """check_digests for the recorded files under the local directory ``root``, hashed by this process."""
    actual = {name: file_sha256(Path(root) / name) for name in expected if (Path(root) / name).is_file()}
    check_digests(expected, actual)


def error_path(metrics_path: str) -> Path:
    return Path(f"{metrics_path}{ERROR_SUFFIX}")


def write_error(metrics_path: str, error: TrainerStateError) -> None:
    """Rank 0 of a local launch: the mismatch for the launcher, which sees only an exit code and a log tail."""
    path = error_path(metrics_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": error.name, "reason": error.reason}))


def read_error(metrics_path: str) -> TrainerStateError | None:
    """The mismatch a failed local rank reported, if that is why it failed."""
    try:
        raw = json.loads(error_path(metrics_path).read_text())
    except (OSError, ValueError):
        return None
    return TrainerStateError(str(raw.get("name")), str(raw.get("reason")))
