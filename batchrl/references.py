"""References to user code, ``"package.module:function"``: custom rewards, pipeline setup steps and user stages.

Why one resolver: all follow the same rules. Loading a pipeline checks only a reference's form
(`is_reference`, a string test); the module is imported, running its top-level code, when the job starts and
before any work (`import_reference`), so a typo fails at once with a message that names it, and a pipeline
can be validated, planned or inspected without importing the rewards and setup steps it names (a plan reads the
source file of each custom reward's module, `source_digest`, so that editing the code re-runs what it scored).
User stages are the exception: `batchrl validate`, `plan` and `run` import their modules where they load the
pipeline (batchrl.stages.user.check_stage_calls), because a stage's ``params`` can only be checked against its
function's signature, and a misspelt one would otherwise surface after ingest and generation.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import re
from pathlib import Path
from typing import Any

_REFERENCE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_reference(text: str) -> bool:
    """Whether ``text`` has the form ``package.module:attribute[.attribute]`` (nothing is imported)."""
    return bool(_REFERENCE.match(text))


def import_reference(reference: str, *, what: str) -> Any:
    """The object at ``"package.module:attribute[.attribute]"``; ValueError naming ``what`` (e.g. "reward
    reference") and the reference otherwise. Imports the module: call it when the job starts, never while a
    pipeline is loaded."""
    module_name, _, attribute_path = reference.partition(":")
    if not module_name or not attribute_path:
        raise ValueError(f"{what} {reference!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or anything the module raises while importing
        raise ValueError(f"cannot import module {module_name!r} of {what} {reference!r}: {error}") from error
    try:
        return functools.reduce(getattr, attribute_path.split("."), module)
    except AttributeError as error:
        raise ValueError(f"{what} {reference!r}: module {module_name!r} has no attribute {attribute_path!r}") from error


def source_digest(reference: str) -> str:
    """sha256 (16 hex digits) of the source file of the module a reference names, found without importing it
    (a dotted name imports its parent packages), for stage fingerprints: editing a custom reward re-runs the
    stages that use it. "unresolved" when the module cannot be found (the job's start then fails, naming it) and
    "no-source" for a module without a source file (built-in, compiled, namespace)."""
    module_name = reference.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return "unresolved"
    if spec is None:
        return "unresolved"
    origin = Path(spec.origin) if spec.origin else None
    if origin is None or not origin.is_file() or origin.suffix != ".py":
        return "no-source"
    return hashlib.sha256(origin.read_bytes()).hexdigest()[:16]
