"""Where a private step's extra time goes (issue 50): the CIFAR-shaped CNN through the ``train`` harness
(:class:`idpsgd.training.Trainer`, what ``idpsgd train`` runs) or a GPT-2 LM through the engine, profiled with
cProfile against the same model trained without privacy, the time grouped by our modules.

Each row of the table is a part of the step, the time of the functions defined in its modules
(``tottime``: the function's own time, so the rows add up; torch's kernels are counted where they are called
from Python, in the row of the module whose code called them is not possible with cProfile, so they form their
own rows ``torch (ops)`` and ``torch.autograd (backward)``).  Both runs see the same batches' sizes; the private
run uses *Scale* with the demo's budgets (three clip norms), Poisson sampling, book-keeping.  CPU time of one
torch thread; cProfile adds about 1 µs per Python call, so Python-heavy rows are overstated alike in both runs.

Usage::

    python bench/profile_step.py cnn [--n 2048] [--batch 256] [--top 25]
    python bench/profile_step.py gpt2 [--layers 12] [--batch 16] [--seq 128] [--steps 3]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: part of the step -> path fragments of the modules it covers (first match wins; order matters)
GROUPS = (
    (
        "provenance (trace, replay)",
        (
            "per_example/bk/provenance",
            "per_example/bk/replay",
            "per_example/bk/intercept",
            "per_example/bk/routing",
            "torch/overrides",
        ),
    ),
    ("per-example norms and clipped sum (bk)", ("per_example/bk/", "per_example/")),
    ("write guard", ("guards/integrity", "guards/fingerprint")),
    ("other checks (decomposition, probes)", ("guards/",)),
    ("sampling and data loading", ("engine/sampling", "torch/utils/data", "idpsgd/data")),
    ("clipping", ("engine/clipping",)),
    ("noise and optimizer", ("engine/noise", "opacus/optimizers", "torch/optim")),
    ("accounting (ledger, filter, journal)", ("idpsgd/accounting", "engine/budget")),
    ("training loop (train harness)", ("idpsgd/training",)),
    ("opacus (other)", ("opacus/",)),
    ("other idpsgd", ("idpsgd/",)),
    ("torch.autograd (backward)", ("torch/autograd", "torch/_tensor.py")),
    ("torch.nn modules and hooks", ("torch/nn/",)),
    ("torch (ops, other)", ("torch/", "<built-in method", "<method")),
)


def group_of(filename: str) -> str:
    f = filename.replace("\\", "/")
    for name, parts in GROUPS:
        if any(p in f for p in parts):
            return name
    return "other (Python, numpy)"


def grouped(profile: cProfile.Profile) -> dict:
    """Seconds of own time per group (cProfile's ``tottime``); a built-in (a torch op, a C method) is counted
    in the group of the Python function that called it, so an op's time goes to the part of the step that
    asked for it (``torch.nn modules``: the model's own forward)."""
    stats = pstats.Stats(profile)
    out: dict = {}
    for (filename, _line, func), (_cc, _nc, tt, _ct, callers) in stats.stats.items():
        if filename != "~" or not callers:
            key = group_of(filename if filename != "~" else func)
            out[key] = out.get(key, 0.0) + tt
            continue
        for (caller_file, _l, caller_func), entry in callers.items():
            key = group_of(caller_file if caller_file != "~" else caller_func)
            out[key] = out.get(key, 0.0) + entry[2]
    return out


def top(profile: cProfile.Profile, n: int) -> list:
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [
        {"function": f"{Path(f).name}:{line}({func})", "calls": nc, "tottime_s": round(tt, 4)}
        for (f, line, func), (_cc, nc, tt, _ct, _callers) in rows
    ]


class Window:
    """A profiler switched on for the steady-state steps only (after ``warm`` steps, off around the harness's
    end-of-epoch evaluation), and the CPU seconds and steps it saw."""

    def __init__(self, warm: int):
        self.profile = cProfile.Profile(time.process_time)
        self.warm, self.steps, self.cpu, self._since = warm, 0, 0.0, None

    def step(self):
        """Called before each step."""
        self.steps += 1
        if self.steps == self.warm + 1:
            self.on()

    def on(self):
        if self._since is None:
            self._since = time.process_time()
            self.profile.enable()

    def off(self):
        if self._since is not None:
            self.profile.disable()
            self.cpu += time.process_time() - self._since
            self._since = None


def cnn_runs(n: int, batch: int, warm: int, seed: int = 0):
    """(nonprivate, private) callables training one epoch of the CIFAR-shaped CNN, each given a Window."""
    import torch
    from torch import nn

    from idpsgd.cli.train_commands import demo_budgets
    from idpsgd.data import Dataset
    from idpsgd.models import create_model
    from idpsgd.training import TrainConfig, Trainer

    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    xt, yt = torch.randn(256, 3, 32, 32, generator=g), torch.randint(0, 10, (256,), generator=g)
    data = Dataset("cifar-shaped", x, y, xt, yt, 10)
    budgets = demo_budgets(n, 1e-5, seed)
    config = TrainConfig(
        method="scale", epochs=1, batch_size=batch, seed=seed, model="tramer_boneh_cifar10", progress=False
    )

    def private(window):
        trainer = Trainer(data, budgets, config)
        trainer.step_hooks.append(lambda *_: window.step())
        evaluate = trainer.evaluate

        def unprofiled_evaluate():
            window.off()
            return evaluate()

        trainer.evaluate = unprofiled_evaluate
        trainer.run()
        window.off()

    def nonprivate(window):
        torch.manual_seed(seed)
        model = create_model("tramer_boneh_cifar10", (3, 32, 32), 10)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True, generator=g
        )
        model.train()
        for xb, yb in loader:
            window.step()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            float(loss.detach())
        window.off()

    return nonprivate, private


def gpt2_runs(layers: int, batch: int, seq: int, steps: int, warm: int, seed: int = 0):
    """(nonprivate, private) callables taking ``warm + steps`` steps of a GPT-2 LM (bench_hf's shape: 768 wide,
    12 heads, vocabulary 50,257; the private one through ``make_private`` in bk, Scale, Poisson batches)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from idpsgd.cli.train_commands import demo_budgets
    from idpsgd.engine import IndividualizedPrivacyEngine

    def model():
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_positions=max(seq, 128))).train()

    n, total = 4 * batch, warm + steps
    ids = torch.randint(0, 50257, (n, seq), generator=torch.Generator().manual_seed(seed))

    def loss_of(m, xb):  # each example's mean token loss, summed over the batch
        logits = m(input_ids=xb).logits[:, :-1].flatten(0, 1)
        per_token = torch.nn.functional.cross_entropy(logits, xb[:, 1:].flatten(), reduction="none")
        return per_token.view(len(xb), -1).mean(1).sum()

    def nonprivate(window):
        base = model()
        opt = torch.optim.SGD(base.parameters(), lr=1e-4)
        for s in range(total):
            window.step()
            opt.zero_grad(set_to_none=True)
            loss_of(base, ids[(s * batch) % n :][:batch]).backward()
            opt.step()
        window.off()

    def private(window):
        priv = model()
        engine = IndividualizedPrivacyEngine(accountant="rdp", seed=seed)
        module, opt, loader = engine.make_private(
            module=priv,
            optimizer=torch.optim.SGD(priv.parameters(), lr=1e-4),
            data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=batch),
            budgets=demo_budgets(n, 1e-5, seed),
            method="scale",
            steps=total + 8,
            max_grad_norm=1.0,
            sample_rate=batch / n,
            grad_sample_mode="bk",
        )
        done = 0
        while done < total:
            for (xb,) in loader:
                window.step()
                opt.zero_grad(set_to_none=True)
                loss_of(module, xb).backward()
                opt.step()
                done += 1
                if done >= total:
                    break
        window.off()

    return nonprivate, private


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=("cnn", "gpt2"))
    ap.add_argument("--n", type=int, default=2048, help="CNN: training examples (default 2048)")
    ap.add_argument("--batch", type=int, default=None, help="expected batch size (CNN 256, GPT-2 16)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="GPT-2: profiled steps (default 3)")
    ap.add_argument("--warm", type=int, default=2, help="steps before the profiler starts (default 2)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dump", default=None, help="write each run's cProfile stats to DUMP.<run>.prof")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    if a.model == "cnn":
        nonprivate, private = cnn_runs(a.n, a.batch or 256, a.warm)
    else:
        nonprivate, private = gpt2_runs(a.layers, a.batch or 16, a.seq, a.steps, a.warm)
    result: dict = {"model": a.model, "load_avg_1min_before": os.getloadavg()[0]}
    for name, fn in (("nonprivate", nonprivate), ("private", private)):
        window = Window(a.warm)
        fn(window)
        profiled = window.steps - a.warm
        groups = grouped(window.profile)
        if a.dump:
            window.profile.dump_stats(f"{a.dump}.{name}.prof")
        result[name] = {
            "profiled_steps": profiled,
            "cpu_ms_per_step": round(1e3 * window.cpu / profiled, 1),
            "groups_ms_per_step": {
                k: round(1e3 * v / profiled, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])
            },
            "top": top(window.profile, a.top),
        }
    result["load_avg_1min_after"] = os.getloadavg()[0]
    text = json.dumps(result, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
