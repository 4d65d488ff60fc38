"""What every config section shares: strict models, the placement marker, and the actor resources of a pooled stage.

Placement: a field that changes where, when or how fast its section's stage works, never what it writes (the
actors and what each reserves, deadlines, how a forward is batched), is marked once, where it is declared, as
``Placement[T]``. A stage's fingerprint dumps its section with `fingerprint_dump`, which leaves the marked fields
out, so changing one re-runs nothing. Why a marker and not a set of names in each stage: the sets drifted, and a
field that changes results but sits in such a set serves a stale table; tests/unit/test_placement_fields.py lists
the marked fields, so that marking one is a decision a reviewer sees.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class _PlacementMarker:
    """The metadata of a `Placement` field (pydantic keeps unknown Annotated metadata in FieldInfo.metadata)."""

    def __repr__(self) -> str:
        return "PLACEMENT"


PLACEMENT = _PlacementMarker()
T = TypeVar("T")
Placement = Annotated[T, PLACEMENT]


def placement_fields(model: type[BaseModel]) -> frozenset[str]:
    """The names of ``model``'s fields marked ``Placement``."""
    return frozenset(name for name, field in model.model_fields.items() if PLACEMENT in field.metadata)


def fingerprint_dump(
    section: BaseModel, *, exclude_defaults: bool = False, exclude: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``section`` as a stage's fingerprint holds it: its fields but the ``Placement`` ones and ``exclude`` (the
    fields of the sections nested in it whole: a stage dumps those as it always did)."""
    dropped = placement_fields(type(section)) | exclude
    return section.model_dump(exclude=set(dropped), exclude_defaults=exclude_defaults)


class ActorResources(_Strict):
    """The actor pool of a stage whose shards run over Ray actors (generate, a reward model's score, values, a user
    stage): its fields keep their names in each section that has one (generate.num_actors, critic.gpus_per_actor)."""

    num_actors: Placement[int] = Field(
        1,
        ge=1,
        description="Actors in the stage's pool; each builds what it holds once (an engine, a model, a user stage's "
        "Class) and takes the shards one at a time.",
    )
    cpus_per_actor: Placement[float] = Field(1.0, gt=0, description="CPUs each actor reserves.")
    gpus_per_actor: Placement[float] = Field(
        0.0,
        ge=0,
        description="GPUs each actor reserves: > 0 runs generate's engines, the reward model and the critic on CUDA "
        "(a user stage's code picks its own device).",
    )
