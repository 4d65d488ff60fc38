"""The optimizer states of a run's policies: which one an update continues, whether it is intact, and pruning.

An update saves its AdamW moments under ``<policy>/_trainer_state/`` (the files of `batchrl.trainer.checkpoint`)
and records each file's size and sha256 in the policy manifest's ``trainer_state``, apart from its parts:
keep-last-K deletes states later, and a listed part that disappeared would read as damage. The next update
continues that state, so the iterations train like one long run. This module reads those records (manifests and
listings only, never a state's bytes: loading one unpickles it, and the ranks check the sha256 first, see
`batchrl.trainer.integrity`), turns a state that cannot be continued into a data error that says which updates to
redo, copies a remote state to local disk, and deletes states older than ``update.keep_last_k_optimizer_states``.

Torch-free, like `integrity`: the update stage's driver imports it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from batchrl.config import PipelineConfig
from batchrl.errors import DataError
from batchrl.storage import RunLayout, is_local, join, resolve
from batchrl.storage.manifest import PartInfo, file_sizes, read_manifest

logger = logging.getLogger(__name__)

TRAINER_STATE_DIR = "_trainer_state"
TRAINER_STATE_FILE = "trainer_state.json"  # as batchrl.trainer.checkpoint writes it (not imported: torch)


@dataclass(frozen=True)
class RecordedState:
    """The optimizer state saved with an update's input policy, as the policy's manifest records it."""

    uri: str  # the input policy's _trainer_state/ in the run directory
    sha256: dict[str, str] | None  # relative path -> sha256 recorded by its writer; None: not recorded (older batchrl)


class TrainerStateStore:
    """The trainer states of one run: ``cfg`` (the run id and the update's keep/trust options) and ``layout`` (where
    each iteration's policy lives)."""

    def __init__(self, cfg: PipelineConfig, layout: RunLayout):
        self.run_id = cfg.run_id
        self.keep_last_k = cfg.update.keep_last_k_optimizer_states
        self.allow_unverified = cfg.update.allow_unverified_trainer_state
        self.layout = layout

    def recorded(self, *, iteration: int | None, policy_in: str) -> RecordedState | None:
        """The optimizer state saved with ``policy_in``, for iteration ``iteration``'s update to continue. Reads the
        manifest and lists the state's files, nothing else: the runner asks it before it clears the update's output
        directory (`check_ready`), and the update again when it starts.

        None where the update starts from fresh moments by design: iteration 0 (model.path, or a warm start from
        another run's policy: `run.init_from` carries weights, not optimizer state), keep_last_k_optimizer_states 0,
        or an input policy whose update saved no state (it had no rows to train on). A state the manifest records
        but that is gone, or whose files have another size, is a DataError: restarting AdamW from zero moments would
        silently train differently."""
        if not iteration or self.keep_last_k == 0:
            return None
        uri = join(policy_in, TRAINER_STATE_DIR)
        manifest = read_manifest(policy_in)
        if manifest is None:
            raise DataError(
                f"the input policy {policy_in} of iteration {iteration}'s update has no manifest; "
                f"redo it: batchrl run <pipeline> --run-id {self.run_id} --from-stage update "
                f"--iteration {iteration - 1}"
            )
        if manifest.trainer_state == []:
            return None
        problem = _state_problem(uri, manifest.trainer_state)
        if problem is not None:
            raise self.unusable(uri, *problem, iteration=iteration)
        if manifest.trainer_state is None:
            if not self.allow_unverified:
                raise self._unverifiable(uri, iteration=iteration)
            return RecordedState(uri=uri, sha256=None)
        return RecordedState(uri=uri, sha256={_state_name(p): p.sha256 for p in manifest.trainer_state})

    def log_recorded(self, state: RecordedState | None, *, iteration: int | None, policy_in: str) -> None:
        """Says when an update restarts AdamW after one that saved no state, or continues a state it cannot verify."""
        if state is None and iteration and self.keep_last_k != 0:
            logger.info(
                "iteration %d: the update of %s saved no optimizer state (nothing to train on); AdamW starts "
                "from zero moments",
                iteration,
                policy_in,
            )
        elif state is not None and state.sha256 is None:
            logger.warning(
                "iteration %d: %s records no checksums of its optimizer state (written by an earlier batchrl): "
                "it is loaded unverified (update.allow_unverified_trainer_state)",
                iteration,
                policy_in,
            )

    def unusable(self, uri: str, name: str, reason: str, *, iteration: int) -> DataError:
        """The data error for an optimizer state that cannot be restored, with the command that redoes the updates
        from the last one whose input state is intact."""
        redo = self._redo_command(iteration)
        if reason == "missing":
            return DataError(
                f"iteration {iteration}'s update continues the optimizer state saved with its input policy, but "
                f"{join(uri, name)} is gone (deleted by update.keep_last_k_optimizer_states, or by hand). Restarting "
                f"AdamW from zero moments would silently train differently, so nothing was run. Redo the updates from "
                f"the last one whose input state exists: {redo} (a higher keep_last_k_optimizer_states, or null, keeps "
                f"more)"
            )
        return DataError(
            f"{join(uri, name)}: {reason}. Iteration {iteration}'s update did not load it: loading an optimizer state "
            f"unpickles it, so a file changed after it was written could run code in the trainer. If the run "
            f"directory is trusted, redo the updates from the last one whose input state is intact: {redo}"
        )

    def _unverifiable(self, uri: str, *, iteration: int) -> DataError:
        """The data error for an optimizer state whose writer recorded no checksums, when loading one unverified is
        not allowed: how to allow it, or the command that redoes the updates from the last one whose input state is
        verifiable."""
        return DataError(
            f"iteration {iteration}'s update continues the optimizer state {uri}, whose policy manifest records no "
            f"sha256 of its files (written by an earlier batchrl), so nothing can tell whether they changed since; "
            f"loading an optimizer state unpickles it, and a changed file could run code in the trainer, so nothing "
            f"was run. If only trusted people can write the run directory, allow it: set "
            f"update.allow_unverified_trainer_state: true (or --set update.allow_unverified_trainer_state=true). "
            f"Otherwise redo the updates from the last one whose input state is verifiable: "
            f"{self._redo_command(iteration)}"
        )

    def _redo_command(self, iteration: int) -> str:
        first = self._first_update_to_redo(iteration)
        return f"batchrl run <pipeline> --run-id {self.run_id} --from-stage update --iteration {first}"

    def _first_update_to_redo(self, iteration: int) -> int:
        """The earliest iteration from which the updates can be redone in order: the one after the newest earlier
        policy whose optimizer state is intact and, unless update.allow_unverified_trainer_state, recorded with its
        checksums (or that saved none), else 0 (which needs no state)."""
        for earlier in range(iteration - 2, -1, -1):
            policy_dir = self.layout.table_dir("policy", earlier)
            manifest = read_manifest(policy_dir)
            if manifest is None or (manifest.trainer_state is None and not self.allow_unverified):
                continue
            if (
                manifest.trainer_state == []
                or _state_problem(join(policy_dir, TRAINER_STATE_DIR), manifest.trainer_state) is None
            ):
                return earlier + 1
        return 0

    def prune(self, iteration: int | None) -> None:
        """Deletes the optimizer states of iterations before the K most recent completed ones (never policies): the
        state iteration ``iteration``'s update resumes from is always kept, so a crash before its manifest is
        written can redo it."""
        keep = self.keep_last_k
        if keep is None or not iteration:
            return
        for old_iteration in range(0, iteration - max(keep, 1)):
            uri = join(self.layout.table_dir("policy", old_iteration), TRAINER_STATE_DIR)
            fs, path = resolve(uri)
            if fs.exists(path):
                fs.rm(path, recursive=True)
                logger.info("deleted the optimizer state of iteration %d (%s)", old_iteration, uri)


def local_trainer_state(state: RecordedState, scratch: str) -> str:
    """A local directory with the state's files: the run's own when local, else a download into ``scratch``."""
    if is_local(state.uri):
        return state.uri.removeprefix("file://")
    fs, path = resolve(state.uri)
    target = Path(scratch) / "trainer_state_in"
    for remote in fs.find(path):
        local = target / remote[len(path.rstrip("/")) + 1 :]
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(local))
    return str(target)


def _state_name(part: PartInfo) -> str:
    """A trainer-state file's path under _trainer_state/ (the manifest names it from the policy directory)."""
    return part.name.removeprefix(f"{TRAINER_STATE_DIR}/")


def _state_problem(uri: str, recorded: list[PartInfo] | None) -> tuple[str, str] | None:
    """(file, what is wrong with it) for the first recorded file under ``uri`` that is missing or has another size
    (one listing; sha256 is checked where the files are loaded). Without a record (older manifests), only
    trainer_state.json is looked for."""
    sizes = file_sizes(uri)
    if recorded is None:
        return None if TRAINER_STATE_FILE in sizes else (TRAINER_STATE_FILE, "missing")
    for part in sorted(recorded, key=lambda p: p.name):
        name = _state_name(part)
        if name not in sizes:
            return name, "missing"
        if sizes[name] != part.num_bytes:
            return name, (
                f"{sizes[name]} bytes, not the {part.num_bytes} recorded when it was written (modified or "
                "corrupted since)"
            )
    return None
