"""Plain helpers shared by several test files (fixtures live in ``conftest.py``).

* :func:`per_example_grads` / :func:`per_example_norms`: the reference every per-example-gradient test
  checks the engine against: one backward pass per example, nothing batched, nothing clever;
  :func:`independence_gap`: whether each example's loss in the batch is its loss alone (a refusal of a model
  whose examples do not interact needs another reason than "the examples interact").
* :func:`toy_classification` and :func:`toy_model`: a seeded 6-feature binary task and a small MLP for it.
* :func:`file_mode`: the permission bits of a file, for the checks that private outputs are 0600 and
  private folders 0700; :func:`mode_problems` checks a whole run folder so, and :func:`public_files`
  lists what anyone may read.
* :func:`package_modules`, :func:`imported_names`, :func:`import_edges`, :func:`import_cycles` and
  :func:`private_imports`: the package's import graph read with ``ast`` (relative imports resolved, lazy
  in-function imports counted), for the layout checks (``test_layout.py``, ``test_names.py``,
  ``test_import_cycles.py``).
* :func:`launch`: ``distributed.launch`` with the ranks forked from a fork server that imported torch, opacus
  and idpsgd once; :func:`launch_together`: several distributed scenarios in one launch (a module-scoped
  fixture shares it between the module's tests).
"""

from __future__ import annotations

import ast
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn


def _cross_entropy(model: nn.Module, x, y) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def per_example_grads(
    model: nn.Module,
    x,
    y,
    loss: Callable[[nn.Module, object, object], torch.Tensor] = _cross_entropy,
    params: list[nn.Parameter] | None = None,
) -> torch.Tensor:
    """Each example's loss gradient by its own backward pass: a ``(len(x), P)`` tensor whose row ``i`` is
    the gradient of ``loss(model, x[i:i+1], y[i:i+1])`` (a scalar; default: the cross-entropy of the
    model's output) with respect to ``params`` (default: the model's trainable parameters, in order),
    flattened and concatenated; zeros for a parameter the example's loss does not reach.

    The model's ``.grad`` fields are not touched (``torch.autograd.grad``)."""
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(loss(model, x[i : i + 1], y[i : i + 1]), params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads, strict=True)]
            )
        )
    return torch.stack(rows)


def independence_gap(model: nn.Module, inputs: dict, loss: Callable[[nn.Module, dict], torch.Tensor]) -> float:
    """How far each example's loss in the batch is from its loss alone: the largest |loss_i(batch) - loss_i(alone)|
    relative to the largest |loss_i|, where ``loss(model, inputs)`` gives one loss per example of ``inputs`` (a dict
    of tensors with one row per example; one forward per example for the losses alone).  Rounding-level (below
    1e-12 in float64) when the examples do not interact, so per-example gradients are defined and a refusal needs
    another reason; of order 1 when they do (batch statistics)."""
    with torch.no_grad():
        batched = loss(model, inputs)
        alone = torch.cat([loss(model, {k: v[i : i + 1] for k, v in inputs.items()}) for i in range(len(batched))])
    return float((batched - alone).abs().max() / batched.abs().max().clamp_min(torch.finfo(batched.dtype).tiny))


def per_example_norms(model: nn.Module, x, y, loss=_cross_entropy) -> np.ndarray:
    """‖∇ loss_i‖ of each example (float64 numpy), from :func:`per_example_grads`."""
    return per_example_grads(model, x, y, loss).double().norm(dim=1).numpy()


PRIVATE = "private"  # a run folder's private sub-folder (idpsgd.runfolder.PRIVATE), spelled out here


def file_mode(path) -> int:
    """The permission bits of ``path`` (``stat.S_IMODE``: 0o600 for a private file, 0o700 for a private folder)."""
    return stat.S_IMODE(os.stat(path).st_mode)


def public_files(folder: Path) -> list[Path]:
    """Files outside any ``private/`` folder, and every file that group or others can read (sorted)."""
    out = []
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        if PRIVATE not in p.relative_to(folder).parts or file_mode(p) & 0o077:
            out.append(p)
    return out


def mode_problems(folder: Path) -> list[str]:
    """Every ``private/`` folder under ``folder`` not 0700 and every file inside one not 0600 (empty: all good)."""
    problems = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        mode = file_mode(p)
        if p.is_dir() and p.name == PRIVATE and mode != 0o700:
            problems.append(f"{rel}: mode {mode:o}, expected 700")
        elif PRIVATE in rel.parts and p.is_dir() and mode != 0o700:
            problems.append(f"{rel}: private folder with mode {mode:o}, expected 700")
        elif PRIVATE in rel.parts and p.is_file() and mode != 0o600:
            problems.append(f"{rel}: private file with mode {mode:o}, expected 600")
    return problems


def independent_epsilons(q, sigma, steps, delta):
    """ε of ``steps`` sampled-Gaussian steps by dp_accounting (not our code): its RDP at the order our
    adaptive conversion chose (its fractional-order series sums absolute values, an upper bound), and
    its PLD accountant."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant as dpa

    from idpsgd.accounting import SampledGaussianEvent, rdp_epsilon

    _, order = rdp_epsilon([SampledGaussianEvent(q, sigma, steps)], delta)
    rdp = dpa._compute_rdp_poisson_subsampled_gaussian(q, sigma, [order]) * steps
    rdp_eps = dpa.compute_epsilon([order], rdp, delta)[0]
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)  # pessimistic: a bound
    pld.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return rdp_eps, pld.get_epsilon(delta)


def toy_classification(n: int, weight: float):
    """``n`` standard-normal 6-feature points labelled by the sign of x0 + weight·x1 (seeded)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + weight * x[:, 1] > 0).long()


def toy_model(seed: int = 1) -> nn.Module:
    """A 6 → 8 → 2 tanh MLP for :func:`toy_classification`, initialised from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


SRC = Path(__file__).resolve().parents[1] / "src"


def package_modules() -> dict[str, Path]:
    """Every module of the ``idpsgd`` package by dotted name (a package by its own name, not ``.__init__``)."""
    out = {}
    for f in (SRC / "idpsgd").rglob("*.py"):
        out[".".join(f.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")] = f
    return out


def imported_names(mods: dict[str, Path] | None = None) -> Iterator[tuple[str, str, str | None]]:
    """(module, imported module, name) of every import in ``mods`` (default: :func:`package_modules`), at
    any depth (imports inside functions included): ``from X import name`` gives ``(m, X, name)`` with a
    relative ``X`` resolved against ``m``'s package; ``import X`` gives ``(m, X, None)``."""
    mods = package_modules() if mods is None else mods
    for m, f in mods.items():
        package = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    yield m, target, alias.name
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield m, alias.name, None


def import_edges(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """The package's import graph: module → the other package modules it imports (lazy imports included;
    ``from X import y`` is an edge to the module ``X.y`` where there is one, else to ``X``, so
    ``from . import x`` is an edge to ``x``)."""
    mods = package_modules() if mods is None else mods
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, target, name in imported_names(mods):
        full = f"{target}.{name}"
        dep = full if name is not None and full in mods else target
        if dep in mods and dep != m:
            edges[m].add(dep)
    return edges


def import_cycles(edges: dict[str, set[str]] | None = None) -> list[list[str]]:
    """The import circles of ``edges`` (default: :func:`import_edges`): its strongly connected components
    of more than one module, each sorted (Tarjan, iterative)."""
    edges = import_edges() if edges is None else edges
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def private_imports(mods: dict[str, Path] | None = None) -> list[tuple[str, str, str]]:
    """(importer, defining module, name) of every private name (``_x``, not ``__x``) imported from an
    ``idpsgd`` module, lazy imports included (a private *module* imported as ``from . import _x`` is not a
    private name), sorted."""
    mods = package_modules() if mods is None else mods
    return sorted(
        {
            (m, target, name)
            for m, target, name in imported_names(mods)
            if name and name.startswith("_") and not name.startswith("__")
            if target.startswith("idpsgd") and f"{target}.{name}" not in mods
        }
    )


def _run_in_turn(calls: dict) -> dict:
    """On every rank: each ``name: (fn, kwargs)`` of ``calls`` in turn, in one process group; returns
    ``{name: result}`` and ``seconds`` (rank 0's time per call)."""
    import time

    out, seconds = {}, {}
    for name, (fn, kwargs) in calls.items():
        start = time.perf_counter()
        out[name] = fn(**kwargs)
        seconds[name] = time.perf_counter() - start
    return {**out, "seconds": seconds}


# what every rank of the suite's launches imports: preloaded once in the fork server (see :func:`launch`)
PRELOADED = ("torch", "numpy", "scipy.stats", "opacus", "idpsgd.engine", "idpsgd.training", "support")


def _fork_server():
    """The multiprocessing context of the fork server, told to preload :data:`PRELOADED` (no effect once the
    server has started: it is started once per process, by its first child)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    return ctx


#: FSDP2 across processes on CPUs (gloo) records events on ``torch.cpu.Stream``, which torch 2.6 lacks (the engine
#: refuses such a model there: ``fsdp._check_cpu_streams``)
cpu_fsdp = pytest.mark.skipif(
    not hasattr(torch.cpu.Stream, "record_event"), reason="FSDP2 on CPUs needs torch.cpu.Stream.record_event"
)


def launch(fn, nproc: int, args=(), kwargs=None, *, timeout_s: float):
    """``distributed.launch`` with ranks forked from the fork server, which imports :data:`PRELOADED` once per
    test process: a spawn imports torch, opacus and idpsgd in every rank of every launch (4-5 s of CPU each,
    most of a small scenario).  The ranks run the same code as under the default ``spawn``; the server sees
    the environment of its start (set nothing in ``os.environ`` for a rank: pass it as an argument)."""
    from idpsgd.engine import distributed

    _fork_server()
    return distributed.launch(fn, nproc, args, kwargs, timeout_s=timeout_s, start_method="forkserver")


def _cli_in_child(argv: list, env: dict, threads: int, out: str, show_warnings: bool) -> None:
    import sys
    import warnings

    from idpsgd.cli import main

    os.environ.update(env)
    torch.set_num_threads(threads)
    with open(f"{out}.stdout", "w") as so, open(f"{out}.stderr", "w") as se:
        os.dup2(so.fileno(), 1)
        os.dup2(se.fileno(), 2)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # noqa: SIM115
        with warnings.catch_warnings():
            if not show_warnings:
                warnings.simplefilter("ignore")
            code = main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def cli_process(
    argv: list, tmp: Path, env: dict | None = None, timeout_s: float = 600, show_warnings: bool = False
) -> tuple[int, str, str]:
    """``idpsgd <argv>`` in a process of its own, forked from the fork server of :func:`launch` (its imports
    done once per test process), with ``env`` added to its environment and this process's torch thread count
    (the same float reductions as a run here): ``(exit code, stdout, stderr)``, the code negative for a
    signal (-9: SIGKILL, as the crash tests' ``IDPSGD_TEST_KILL`` does).  Python's warnings are ignored
    unless ``show_warnings`` (then the filters are a fresh interpreter's: the server only imported modules)."""
    ctx = _fork_server()
    out = tmp / f"cli-{os.getpid()}-{len(list(tmp.glob('cli-*.stderr')))}"
    proc = ctx.Process(
        target=_cli_in_child, args=(list(argv), dict(env or {}), torch.get_num_threads(), str(out), show_warnings)
    )
    proc.start()
    proc.join(timeout_s)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise TimeoutError(f"idpsgd {' '.join(argv)} ran past {timeout_s} s")
    texts = [Path(f"{out}.{name}") for name in ("stdout", "stderr")]
    return proc.exitcode, *(p.read_text() if p.exists() else "" for p in texts)


def launch_together(nproc: int, calls: dict, timeout_s: float) -> dict:
    """Several scenarios of ``distributed.launch`` that end normally, run one after the other in ONE
    launch of ``nproc`` processes (:func:`launch`): a launch costs a process group and a process per rank,
    so a test module shares one through a module-scoped fixture.  A rank
    that raises fails the launch, and with it every test of the fixture (with the rank's error).
    Scenarios that kill or hang a rank keep their own launch."""
    return launch(_run_in_turn, nproc, (calls,), timeout_s=timeout_s)
