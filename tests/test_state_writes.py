"""No attribute of another object is set from outside its class in the engine (issue 49, "state flows one
way"): a part changes another part's state by calling one of its methods or by constructing it, never by
assigning its fields.  Read with ``ast`` from ``src/idpsgd/engine``: every attribute assignment, augmented
assignment, deletion, ``setattr``/``delattr`` and ``object.__setattr__`` whose object is not ``self`` or
``cls``.  What stays is another library's contract (:data:`CONVENTIONS`, by attribute name; an autograd
``ctx``) or listed below with the reason (:data:`KEPT`, :data:`KEPT_IN`); a listed write that is gone
fails too, so the list stays the true one."""

from __future__ import annotations

import ast
from pathlib import Path

import idpsgd.engine

ENGINE = Path(idpsgd.engine.__file__).parent  # the engine imported (PYTHONPATH=src: the checkout's)

#: attribute -> the library whose contract it is, and why it is set where it is
CONVENTIONS = {
    "grad": "torch: a parameter's gradient, what the wrapped optimizer's step reads",
    "grad_sample": "Opacus: per-sample gradients on the parameter (GradSampleModule -> DPOptimizer)",
    "summed_grad": "Opacus: the clipped sum on the parameter (DPOptimizer.clip_and_accumulate)",
    "_norm_sample": "Opacus: per-sample norms on the parameter (ghost clipping)",
    "_forward_counter": "Opacus: the parameter's forward passes awaiting their backward pass",
    "max_batch_len": "Opacus: set on a layer by its capture hook, removed with the activations",
    "autograd_grad_sample_hooks": "Opacus: the hook handles GradSampleModule keeps on the model",
    "ft_compute_sample_grad": "Opacus: the functorch per-sample function prepare_layer puts on a layer",
    "training": "torch: a module's train/eval flag, set module by module (Module.train() recurses)",
}

#: (path under engine/, the target as written) -> why this write on another object stays
KEPT = {
    ("per_example/bk/intercept.py", "module.forward"): (
        "torch: one module's forward overridden by an instance attribute, in the one adapter override_forward"
    ),
    ("guards/integrity.py", "object.__setattr__(model, key)"): (
        "torch: the engine's per-model objects kept on the user's module as plain attributes, not submodules, "
        "in the one adapter per_model"
    ),
    ("distributed/fsdp.py", "wrapped.__class__"): (
        "the engine's own ghost wrapper becomes its sharded subclass (methods only; Opacus's hooks re-added)"
    ),
    ("distributed/sharded_checkpoint.py", "metadata.storage_meta"): (
        "torch.distributed.checkpoint: a StorageReader's read_metadata stamps the metadata it returns"
    ),
    ("distributed/sharded_checkpoint.py", "metadata.storage_meta.load_id"): (
        "torch.distributed.checkpoint: a StorageReader's read_metadata stamps the metadata it returns"
    ),
    ("distributed/__init__.py", "err.args"): "an exception rebuilt from another rank's record keeps that message",
    ("sampling/sampler.py", "self.rng.bit_generator.state"): "numpy: how a Generator's state is restored",
}

#: (path under engine/, function) -> why it sets fields of an object other than ``self``: inside its own
#: class, on an instance it is making
KEPT_IN = {
    ("budget/accountant.py", "GroupEpsilons.__new__"): "a float subclass's fields, set in its __new__",
    ("noise/randomness.py", "RunSeeds.with_values"): "a copy of its own class, being made",
    ("noise/randomness.py", "RunSeeds.following"): "a copy of its own class, being made",
    ("per_example/bk/shared.py", "SharedTensor.wrap"): "a tensor subclass's fields, on the view as_subclass made",
    ("per_example/bk/shared.py", "SharedTensor.__torch_function__"): "a SharedTensor it made (SharedTensor.wrap)",
}


def _writes(tree: ast.Module):
    """(function qualname, object expression, attribute or call as written) of every write on another object."""
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, (*scope, child.name))
                continue
            targets = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                targets = [child.target]
            elif isinstance(child, ast.Delete):
                targets = child.targets
            for t in targets:
                for e in t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]:
                    if isinstance(e, ast.Attribute) and not (
                        isinstance(e.value, ast.Name) and e.value.id in ("self", "cls")
                    ):
                        found.append((".".join(scope), ast.unparse(e.value), e.attr, ast.unparse(e)))
            if isinstance(child, ast.Call):
                name = ast.unparse(child.func)
                if name in ("setattr", "delattr") or name.endswith(("__setattr__", "__delattr__")):
                    obj = ast.unparse(child.args[0]) if child.args else ""
                    if obj not in ("self", "cls"):
                        found.append((".".join(scope), obj, None, ast.unparse(child)))
            visit(child, scope)

    visit(tree, ())
    return found


def _engine_writes():
    out = []
    for path in sorted(ENGINE.rglob("*.py")):
        rel = path.relative_to(ENGINE).as_posix()
        for scope, obj, attr, written in _writes(ast.parse(path.read_text())):
            out.append((rel, scope, obj, attr, written))
    return out


def _kept_call(written: str) -> str:
    """``object.__setattr__(model, key, found)`` -> ``object.__setattr__(model, key)`` (the listed form)."""
    head, _, args = written.partition("(")
    return f"{head}({', '.join(a.strip() for a in args.rstrip(')').split(',')[:2])})"


def _check_the_finder() -> None:
    """The finder sees every form of write (else the check below would pass by seeing nothing)."""
    tree = ast.parse(
        "class K:\n"
        "    def m(self, other):\n"
        "        self.mine = 1\n"
        "        other.a = 1\n"
        "        other.b += 1\n"
        "        other.c: int = 1\n"
        "        del other.d\n"
        "        other.e, self.also_mine = 1, 2\n"
        "        setattr(other, 'f', 1)\n"
        "        object.__setattr__(other, 'g', 1)\n"
        "        self.part.h = 1\n"
    )
    written = [w for _, _, _, w in _writes(tree)]
    assert written == [
        "other.a",
        "other.b",
        "other.c",
        "other.d",
        "other.e",
        "setattr(other, 'f', 1)",
        "object.__setattr__(other, 'g', 1)",
        "self.part.h",
    ]
    assert {scope for scope, *_ in _writes(tree)} == {"K.m"}


def test_no_engine_part_sets_another_objects_attributes():
    _check_the_finder()
    unlisted, seen = [], set()
    for rel, scope, obj, attr, written in _engine_writes():
        if attr in CONVENTIONS or obj == "ctx":  # another library's contract; an autograd Function's context
            continue
        if (rel, scope) in KEPT_IN:
            seen.add((rel, scope))
            continue
        key = (rel, written if attr is not None else _kept_call(written))
        if key in KEPT:
            seen.add(key)
            continue
        unlisted.append(f"engine/{rel} in {scope or 'the module'}: {written}")
    assert not unlisted, (
        "attributes of another object set from outside its class (give that class a method or a constructor "
        "argument, or list an external convention here with the reason):\n" + "\n".join(unlisted)
    )
    stale = sorted((set(KEPT) | set(KEPT_IN)) - seen)
    assert not stale, f"listed writes that are gone (take them off the lists): {stale}"


def test_the_methods_that_replace_outside_writes_refuse_what_they_cannot_honour():
    """The accountant's unit and a ledger's step count were assigned from outside (``accountant.unit = ...``,
    ``ledger.steps += 1``); their methods now name what is allowed."""
    import pytest

    from idpsgd.accounting.ledger import RdpLedger
    from idpsgd.engine.budget.accountant import GroupAccountant
    from idpsgd.validation import InvalidParameterError

    accountant = GroupAccountant(None, "rdp", num_examples=4)
    accountant.count_units("user")
    assert accountant.unit == "user"
    with pytest.raises(InvalidParameterError, match="unit.*users.*example.*user"):
        accountant.count_units("users")
    ledger = RdpLedger(3)
    ledger.count_steps(2)
    assert ledger.steps == 2
    with pytest.raises(ValueError, match="n=-1 is invalid"):
        ledger.count_steps(-1)
    assert ledger.steps == 2


def test_no_cli_command_writes_the_parsed_arguments(tmp_path):
    """The CLI never carries a command's state on argparse's namespace (``args._notes``,
    ``args._resolved_seed``, a default filled in by assignment): derived flags are a new namespace
    (``registry.with_flags``, filled before the command runs by its ``@fills`` function), the seed one
    ``CommandSeed`` passed on, the notes returned (``registry.Noted``).  Only an argparse ``Action`` writes
    the namespace, as argparse's contract (``TypedStore.__call__``)."""
    import idpsgd.cli

    written = [
        f"cli/{path.name} in {scope}: {w}"
        for path in sorted(Path(idpsgd.cli.__file__).parent.rglob("*.py"))
        for scope, obj, _attr, w in _writes(ast.parse(path.read_text()))
        if obj in ("args", "namespace", "ns") and scope != "TypedStore.__call__"
    ]
    assert not written, "argparse's namespace written after parsing:\n" + "\n".join(written)

    # train's derived flags: a new namespace, the parsed one as it was
    from idpsgd.cli.main import build_parser
    from idpsgd.cli.registry import COMMANDS, settled

    (tmp_path / "train.csv").write_text("f0,label,epsilon,uid\n0.5,1,2.0,a\n")
    flags = ["train", "--method", "sample", "--dataset", "csv", "--num-classes", "2", "--user-column", "uid"]
    flags += ["--drop-columns", "f9"]
    args = build_parser().parse_args([*flags, "--data-dir", str(tmp_path), "--out", str(tmp_path / "run")])
    filled = settled(COMMANDS["train"][2], args)
    assert (filled.budgets_file, filled.drop_columns) == (str(tmp_path / "train.csv"), "f9,uid")
    assert (args.budgets_file, args.drop_columns) == (None, "f9")


def test_a_commands_seed_is_resolved_once_at_its_first_use():
    """``CommandSeed`` replaces the seed cached on the namespace: a fresh seed is drawn once and every
    use gets it; a bad ``--seed`` is refused at the first use (where the command read it), not when built;
    a resumed run's recorded seed is taken as it is."""
    import pytest

    from idpsgd.cli.budget_args import CommandSeed, assignment_seed
    from idpsgd.validation import InvalidParameterError

    fresh = CommandSeed(None, False)
    assert fresh() == fresh() == assignment_seed(fresh)
    bad = CommandSeed(-1, False)  # built without a refusal
    with pytest.raises(InvalidParameterError, match="seed"):
        bad()
    with pytest.raises(InvalidParameterError, match="secure mode"):
        CommandSeed(3, True)()
    assert CommandSeed(None, True)() is None
    assert CommandSeed(None, False, recorded=7)() == 7
