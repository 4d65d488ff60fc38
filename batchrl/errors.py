"""The errors a user can cause, one module below everything else, and the exit code each maps to.

The command line turns them into one line and an exit code (README, "Exit codes"); anything else that escapes
is a bug and keeps its traceback.

- ConfigError (exit 2): a configuration mistake, found before any work starts; the message names the field.
- DataError (exit 3): the input data cannot be processed as configured (missing column, unreadable file).
- StorageError (exit 3, or 4 when transient): a data location cannot be read or written.

`type_phrase` names what a wrong value is in these messages ("prompt is an integer", not "prompt is a int").
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user's configuration mistake; the message says which field and how to fix it."""


class DataError(RuntimeError):
    """The input data cannot be processed as configured (missing column, unreadable file); exit code 3."""


class StorageError(RuntimeError):
    """A data location cannot be read or written (missing file, bad URI, unreachable store)."""


_TYPE_PHRASES = {
    bool: "a boolean",
    int: "an integer",
    float: "a float",
    str: "a string",
    bytes: "bytes",
    dict: "a dict",
    list: "a list",
    type: "a class",
}


def type_phrase(value: object) -> str:
    """What ``value`` is, with its article, for a message: "an integer", "a string", "None", "a module", "an
    ndarray" (Python's own names read "a int", "a str", "a NoneType")."""
    if value is None:
        return "None"
    phrase = _TYPE_PHRASES.get(type(value))
    if phrase is not None:
        return phrase
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


class RayStartError(RuntimeError):
    """Ray could not be started (the embedded one) or joined (a cluster), e.g. "The current node timed out during
    startup" on an overloaded machine: nothing has run yet, so the command line says so in one line and exits 4,
    like other transient failures that a scheduler retries."""


NOTE_CHARS = 4000  # of a crashed process's output, in its ProcessCrash's note


class ProcessCrash(RuntimeError):
    """A process of the run died of a signal (SIGABRT, SIGSEGV, SIGKILL, ...) rather than raising: an update rank,
    or an actor that Ray's retries could not bring through its job. Not the user's doing (exit 1), but not a
    traceback either: the command line prints one line naming the stage, the process and the signal, with the path
    of the log that holds the details (`log_path`, written by the runner, which also sets `stage`). Nothing the
    process was writing was committed (manifests are written last), so the same command resumes the run."""

    def __init__(self, *, process: str, signal_name: str, details: str):
        super().__init__(f"{process} died of {signal_name}")
        self.process = process
        self.signal_name = signal_name
        self.details = details
        self.stage: str | None = None
        self.log_path: str | None = None
        if details:  # shown under a traceback (a test's report, --verbose), never in the command's one line
            self.add_note(f"the last output of {process}:\n{details[-NOTE_CHARS:]}")

    def one_line(self) -> str:
        where = f" in {self.stage}" if self.stage else ""
        log = f"; details in {self.log_path}" if self.log_path else ""
        return f"{self.process} died of {self.signal_name}{where}{log}; run the same command to resume"


def signal_name(returncode: int) -> str:
    """ "SIGABRT" for a process's return code -6 (killed by signal 6); "exit code N" for any other code."""
    import signal

    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"
