"""Setup steps: the functions a pipeline's ``setup:`` names, which `batchrl run` calls before the run starts.

Why a hook at all: some pipelines need something to exist before the run reads it. The quickstart builds its toy
model and prompts (``batchrl_toy:setup_toy_assets``); a nightly job may fetch a dataset snapshot. The runner
knows none of them: the command line calls them, then hands the config to the runner.

Why the command line and not the runner or the plan: a step prepares inputs, it is not a stage. It makes no
table and has no fingerprint, so `batchrl plan` and `batchrl status` need not (and do not) run it: every
fingerprint comes from the config alone (model.path, data.train_files as strings), never from what a step
builds. The flip side, as for any input edited in place: a step that rewrites files under a path the config
already names leaves completed stages complete.

Resolution follows a custom reward's rules (batchrl.references): loading a pipeline checks only the form of
``call``; here every step's module is imported and its function checked (callable, takes ``arguments``) before
the first step runs, so a typo in the last step fails before the first one does any work.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from batchrl.config.models import SetupStep
from batchrl.errors import ConfigError, type_phrase
from batchrl.references import import_reference

logger = logging.getLogger(__name__)


def run_setup_steps(steps: Mapping[str, SetupStep]) -> None:
    """Resolves every step, then calls each in order. ConfigError naming ``setup.<name>...`` for a step that cannot
    be resolved (nothing has run then) or that rejects its arguments; other errors of a step propagate as they are."""
    calls = [(name, resolve_setup_step(name, step)) for name, step in steps.items()]
    for name, call in calls:
        logger.info("setup.%s: %s", name, steps[name].call)
        started = time.time()
        try:
            call()
        except ConfigError as err:
            raise ConfigError("\n".join(f"setup.{name}: {line}" for line in str(err).splitlines())) from None
        logger.info("setup.%s: done in %.1f s", name, time.time() - started)


def resolve_setup_step(name: str, step: SetupStep) -> Callable[[], Any]:
    """The step as a call without arguments; ConfigError naming ``setup.<name>.call`` or ``.arguments``."""
    try:
        function = import_reference(step.call, what="function")
    except ValueError as err:
        raise ConfigError(
            f"setup.{name}.call: {err}; name a function importable from the job's Python path "
            "(an installed package, or PYTHONPATH)"
        ) from None
    if not callable(function):
        raise ConfigError(f"setup.{name}.call: {step.call!r} names {type_phrase(function)}, not a function")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        signature = None  # some builtins have no introspectable signature; let the call decide
    if signature is not None:
        try:
            signature.bind(**step.arguments)
        except TypeError as err:
            raise ConfigError(
                f"setup.{name}.arguments: {step.call} cannot be called with them ({err}); its "
                f"parameters: {_parameters(signature)}"
            ) from None
    return functools.partial(function, **step.arguments)


def _parameters(signature: inspect.Signature) -> str:
    named = [
        p.name + ("" if p.default is inspect.Parameter.empty else "=...")
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    return ", ".join(named) or "none"
