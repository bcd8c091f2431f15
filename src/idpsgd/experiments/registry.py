"""The registry of paper experiments behind ``idpsgd reproduce NAME``.

An experiment is a library function ``run(data, *, model=None, progress=True, **options) -> dict``
(JSON-able result; per-example values, if any, under the key ``"private"``), a writer
``write(out, result) -> [file names]`` that puts the result into a
:class:`~idpsgd.runfolder.RunFolder` (each file public or private), and the list of its options.
An option is one keyword of ``run``: the flag ``--name`` (``--no-name`` for a boolean that defaults
to true) whose default is ``run``'s own default, so the library and the CLI never disagree.
``run`` may also take ``out`` (the run folder, for files written while it runs).

Registering an experiment is one call in its module, plus the module's name in
:data:`idpsgd.experiments.MODULES`::

    register(Experiment("thudi-figure1", "Thudi et al. Fig. 1: ...", run_thudi_figure1, write_thudi_figure1,
                        options=(Option("seeds", "seeds 0..N-1", at_least_one), ...),
                        paper_models={"mnist": "lenet5"}))

No torch here: the registry is read to build ``idpsgd --help``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..validation import InvalidParameterError, check_delta

EXPERIMENTS: dict[str, Experiment] = {}


# --- checks of option values (each raises InvalidParameterError(name, value, allowed)) -----------
def at_least_one(name: str, value) -> None:
    """An integer >= 1 (seeds, epochs, batch sizes, rounds)."""
    if isinstance(value, bool) or int(value) != value or int(value) < 1:
        raise InvalidParameterError(name, value, "must be an integer >= 1")


def at_least_zero(name: str, value) -> None:
    """An integer >= 0."""
    if isinstance(value, bool) or int(value) != value or int(value) < 0:
        raise InvalidParameterError(name, value, "must be an integer >= 0")


def optional_seed(name: str, value) -> None:
    """None (a fresh seed) or an integer >= 0."""
    if value is not None:
        at_least_zero(name, value)


def positive(name: str, value) -> None:
    """A finite number > 0 (learning rates, clip norms)."""
    if not (float(value) > 0 and math.isfinite(float(value))):
        raise InvalidParameterError(name, value, "must be > 0")


def valid_delta(name: str, value) -> None:
    """A δ in (0, 1)."""
    check_delta(value, name)


@dataclass(frozen=True)
class Option:
    """One keyword ``name`` of an experiment's ``run`` as a flag (``--name``, ``--no-name`` for a
    boolean defaulting to true, ``--name`` as a switch for one defaulting to false).

    ``check(name, value)`` raises :class:`InvalidParameterError`; ``type`` defaults to the type of
    the default.
    """

    name: str
    help: str
    check: Callable[[str, Any], None] | None = None
    type: Callable | None = None


#: The ``seed`` option every experiment takes: the base of its repetitions' seeds (private).
SEED = Option(
    "seed",
    "base seed: repetition k trains with a seed derived from it (default: a fresh one); recorded "
    "privately in OUT/private/seed.json (mode 0600), never in a public file",
    optional_seed,
    type=int,
)


@dataclass(frozen=True)
class Experiment:
    """One paper's headline experiment (see the module docstring)."""

    name: str
    help: str
    run: Callable[..., dict]
    write: Callable[..., list]
    options: tuple[Option, ...] = ()
    #: dataset -> the paper's model for it (datasets not listed use the library's default model)
    paper_models: dict = field(default_factory=dict)
    #: one line on stdout from the result (public values only); default: the JSON keys
    text: Callable[[dict], str] | None = None
    #: the description of ``--out`` (which files land there)
    out_help: str = "folder for the table, figures and JSON"
    #: the longer text of ``idpsgd reproduce NAME --help``
    description: str = ""
    #: the help of ``--model`` (default: built from ``paper_models``)
    model_help: str = ""

    def defaults(self) -> dict:
        """``run``'s keyword defaults: the flags' defaults."""
        return {
            k: v.default
            for k, v in inspect.signature(self.run).parameters.items()
            if v.default is not inspect.Parameter.empty
        }

    def takes_folder(self) -> bool:
        return "out" in inspect.signature(self.run).parameters


def register(experiment: Experiment) -> Experiment:
    """Add ``experiment`` to :data:`EXPERIMENTS` (its options must be keywords of its ``run``)."""
    defaults = experiment.defaults()
    missing = [o.name for o in experiment.options if o.name not in defaults]
    if missing:
        raise TypeError(f"experiment {experiment.name}: options without a default in run(): {missing}")
    EXPERIMENTS[experiment.name] = experiment
    return experiment
