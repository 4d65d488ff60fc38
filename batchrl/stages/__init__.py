"""The built-in stages, registered in pipeline order on import."""

from batchrl.stages import ingest, generate, score, advantage, update, evaluate  # noqa: F401  (order = pipeline order)
