"""The built-in stages, registered in run order on import: this import list is where the run order is configured.

The runner knows no stage by name (see batchrl/pipeline/stage.py): it runs the once-per-run stages (ingest), then
each iteration's stages in this order. A stage added later (`@register` in its own module, imported after this
package) runs after these, every iteration.
"""

from batchrl.stages import ingest, generate, score, advantage, update, evaluate  # noqa: F401  (order = run order)
