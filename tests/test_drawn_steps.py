"""Every noise draw made under a run folder is charged (issue 53, item 2): the engine's journal of
drawn steps (``private/drawn_steps.jsonl``) and what a resume charges.  The issue's sizes: q 0.125,
one budget 1 calibrated for 8 steps; a secure resume from checkpoint 2 after 4 drawn steps releases
2 more draws (ε 1.088 for all 10), after a finished run 6 more (ε 1.244 for all 14).  ε is compared
with dp_accounting's composition of the same number of sampled-Gaussian steps."""

import json
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from idpsgd.engine import IndividualizedPrivacyEngine, PrivacyBudgetExceeded
from idpsgd.engine.budget.journal import JOURNAL, read_records
from idpsgd.validation import InvalidParameterError
from support import file_mode, independent_epsilons, toy_classification, toy_model

N, BATCH, STEPS, DELTA = 64, 8, 8, 1e-5  # q = 8/64 = 0.125


def _engine(journal, secure, filter_action="raise", seed=7):
    x, y = toy_classification(N, 0.5)
    model = toy_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = IndividualizedPrivacyEngine(accountant="rdp", secure_mode=secure, seed=None if secure else seed)
    engine.attach_journal(journal)
    module, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=BATCH),
        budgets=np.full(N, 1.0),
        target_delta=DELTA,
        method="uniform",
        steps=STEPS,
        max_grad_norm=1.0,
        grad_sample_mode="hooks",
        filter_action=filter_action,
    )
    return engine, module, opt, iter(_batches(loader))


def _batches(loader):
    while True:
        yield from loader


def _steps(run, n):
    _, module, opt, batches = run
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # filter_action="warn" past the budget
        for _ in range(n):
            x, y = next(batches)
            opt.zero_grad(set_to_none=True)
            if len(y):
                torch.nn.functional.cross_entropy(module(x), y).backward()
            opt.step()


def _checkpoint(run):
    """The engine's state and the model's (what a training checkpoint holds of them)."""
    return run[0].state_dict(), {k: v.clone() for k, v in run[1]._module.state_dict().items()}


def _resume(journal, checkpoint, secure, **kw):
    run = _engine(journal, secure, **kw)
    run[1]._module.load_state_dict(checkpoint[1])
    run[0].load_state_dict(checkpoint[0])
    return run


def _params(run):
    return torch.cat([p.detach().flatten() for p in run[1].parameters()])


def _independent(engine, steps):
    """dp_accounting's RDP ε of ``steps`` steps at the run's q and σ (one group)."""
    g = engine.privacy_groups()[0]
    return independent_epsilons(g["sample_rate"], g["noise_multiplier"], steps, DELTA)[0]


@pytest.fixture
def journal(tmp_path):
    private = tmp_path / "run" / "private"
    private.mkdir(parents=True, mode=0o700)
    return private / JOURNAL


@pytest.mark.parametrize(("drawn", "total", "issue_epsilon"), [(4, 10, 1.088), (8, 14, 1.244)])
def test_a_secure_resume_charges_every_draw_after_its_checkpoint(journal, drawn, total, issue_epsilon):
    """A run draws ``drawn`` steps (crashed after step 4, or finished), is resumed from its checkpoint at
    step 2 and trained to its plan's 8 steps again: the draws 3..``drawn`` of the abandoned attempt are
    charged beside the 8 kept, ε is that of ``total`` steps by dp_accounting (with filter_action="warn"
    the run goes past its budget and says so: ε > 1)."""
    first = _engine(journal, secure=True)
    _steps(first, 2)
    checkpoint = first[0].state_dict()
    _steps(first, drawn - 2)
    assert [r["step"] for r in read_records(journal)] == list(range(1, drawn + 1))
    assert file_mode(journal) == 0o600
    resumed = _engine(journal, secure=True, filter_action="warn")
    resumed[0].load_state_dict(checkpoint)
    acc = resumed[0].accountant
    assert (acc.steps, acc.released_steps) == (2, drawn - 2)
    _steps(resumed, STEPS - 2)
    assert (acc.steps, acc.charged_steps) == (STEPS, total)
    eps = resumed[0].get_epsilon()
    assert eps == pytest.approx(_independent(resumed[0], total), rel=1e-4)
    assert eps == pytest.approx(issue_epsilon, abs=2e-3) and eps > 1.0
    assert resumed[0].history[0] == [(pytest.approx(acc.phases[0]["sigma"][0]), 0.125, 8)] + [
        (pytest.approx(acc.phases[0]["sigma"][0]), 0.125, 1)
    ] * (drawn - 2)


def test_with_the_filter_a_resume_stops_at_the_budget_or_takes_no_step(journal):
    """The group filter (filter_action="raise") counts the charged draws: after a crash at step 4 the
    resumed run keeps 6 steps (8 charged, ε within the budget); from checkpoint 2 of a finished run no
    step fits."""
    first = _engine(journal, secure=True)
    _steps(first, 2)
    checkpoint = first[0].state_dict()
    _steps(first, 2)
    resumed = _engine(journal, secure=True)
    resumed[0].load_state_dict(checkpoint)
    kept = 0
    while resumed[0].can_step():
        _steps(resumed, 1)
        kept += 1
    assert kept == 4 and resumed[0].accountant.charged_steps == STEPS
    assert resumed[0].get_epsilon() <= 1.0 and resumed[0].get_epsilon() == pytest.approx(
        _independent(resumed[0], STEPS), rel=1e-4
    )
    with pytest.raises(PrivacyBudgetExceeded):
        _steps(resumed, 1)
    # the finished run (4 + 4 kept, 2 released), resumed from its checkpoint at step 2 once more
    again = _engine(journal, secure=True)
    again[0].load_state_dict(checkpoint)
    assert again[0].accountant.released_steps == 2 + 4 and not again[0].can_step()


def test_a_resume_of_a_resume_charges_each_draw_once(journal):
    """Attempt A draws 1..4 (checkpoint at 2), B resumes from 2 and draws 3..6 (its checkpoint at 4 holds
    A's 3, 4 as charged), C resumes from B's checkpoint at 4: A's draws are not charged twice, B's 5, 6
    are."""
    a = _engine(journal, secure=True, filter_action="warn")
    _steps(a, 2)
    at_2 = a[0].state_dict()
    _steps(a, 2)
    b = _engine(journal, secure=True, filter_action="warn")
    b[0].load_state_dict(at_2)
    _steps(b, 2)
    at_4 = b[0].state_dict()
    _steps(b, 2)
    c = _engine(journal, secure=True, filter_action="warn")
    c[0].load_state_dict(at_4)
    assert (c[0].accountant.steps, c[0].accountant.released_steps) == (4, 4)
    assert len(read_records(journal)) == 8


def test_a_run_started_again_without_a_checkpoint_charges_the_earlier_draws(journal):
    """Killed before its first checkpoint and started again in the same folder: the 3 earlier draws are
    charged (secure mode) from the first step on; a torn last line (killed while appending: no noise was
    drawn for it) is no draw."""
    first = _engine(journal, secure=True)
    _steps(first, 3)
    with open(journal, "ab") as fh:
        fh.write(b'{"format":"idpsgd.drawn-steps/1","step":4,"att')
    again = _engine(journal, secure=True, filter_action="warn")
    assert again[0].get_epsilon() == pytest.approx(_independent(again[0], 3), rel=1e-4)
    _steps(again, 1)
    assert again[0].accountant.charged_steps == 4


def test_a_reproducible_resume_replays_the_same_noise_and_is_charged_once(journal, tmp_path):
    """Seeded: the resumed run's noise generator at step 3 has the state the abandoned attempt drew step 3
    with, so its steps 3..8 are the same outputs: nothing more is charged and the run equals the
    uninterrupted one.  A replay whose generator differs at a recorded step is refused; a checkpoint
    whose generator state differs from the draws after it gets them charged."""
    private = tmp_path / "other" / "private"
    private.mkdir(parents=True)
    whole = _engine(private / JOURNAL, secure=False)
    _steps(whole, STEPS)
    first = _engine(journal, secure=False)
    _steps(first, 2)
    checkpoint = _checkpoint(first)
    _steps(first, 4)
    resumed = _resume(journal, checkpoint, secure=False)
    assert resumed[0].accountant.released_steps == 0 and resumed[0].accountant.pending_steps == 4
    _steps(resumed, STEPS - 2)
    assert resumed[0].finish_journal() == 0
    assert torch.equal(_params(resumed), _params(whole))
    assert resumed[0].accountant.charged_steps == STEPS and resumed[0].get_epsilon() == whole[0].get_epsilon()
    records = read_records(journal)
    assert all(r["noise_state_sha256"] for r in records)
    replayed = {r["step"]: r["noise_state_sha256"] for r in records if r["attempt"] == resumed[0].journal.attempt}
    assert all(r["noise_state_sha256"] == replayed[r["step"]] for r in records if 3 <= r["step"] <= 6)

    tampered = _resume(journal, checkpoint, secure=False)
    tampered[0].noise_source.manual_seed(1)  # not the run's noise any more
    with pytest.raises(RuntimeError, match="does not replay the noise"):
        _steps(tampered, 1)

    other = dict(checkpoint[0], noise=torch.Generator().manual_seed(5).get_state())
    charged = _resume(journal, (other, checkpoint[1]), secure=False, filter_action="warn")
    assert charged[0].accountant.released_steps == 4 + 6  # first's 3..6, resumed's 3..8 (the tampered drew none)


def test_the_draws_a_reproducible_resume_does_not_reach_are_charged_when_it_ends(journal):
    first = _engine(journal, secure=False)
    _steps(first, 2)
    checkpoint = first[0].state_dict()
    _steps(first, 4)
    resumed = _engine(journal, secure=False)
    resumed[0].load_state_dict(checkpoint)
    _steps(resumed, 1)  # the run ends at step 3 (its outputs: steps 4..6 of the first attempt are not replayed)
    assert resumed[0].finish_journal() == 3
    assert resumed[0].accountant.charged_steps == 6
    assert resumed[0].get_epsilon() == pytest.approx(_independent(resumed[0], 6), rel=1e-4)


def test_the_journal_state_travels_in_checkpoints_and_a_broken_journal_is_refused(journal):
    first = _engine(journal, secure=True)
    _steps(first, 2)
    state = first[0].state_dict()
    assert state["journal"]["covered"] == {first[0].journal.attempt: [[1, 2]]}
    json.dumps(state["journal"])  # plain data (checkpoints load with weights_only=True)
    with open(journal, "ab") as fh:
        fh.write(b"not a record\n")
    with pytest.raises(InvalidParameterError, match="journal of drawn steps"):
        _engine(journal, secure=True)  # read at set-up: refused before any step
