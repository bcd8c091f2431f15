"""The architecture surveys: by enumeration (issue 47, ``--enumerate``) and the fixed list of issue 36.

``--enumerate``: every architecture of transformers' auto-model mappings, built tiny from its config
(``tests/hf_enumeration.py``), in every mode (idpsgd's bk, ghost, hooks; Opacus's hooks and ghost) at
T != B, T = B and a padded batch with its mask, against one backward pass per example in float64.
Each architecture runs in a forked process with a timeout (a hang or a signal is a crash cell, never
the end of the survey); its record is written atomically to ``bench/results/architectures/<type>__<task>.json``
and reused by the next run (``--fresh`` recomputes); at the end the records are merged into
``bench/results/architectures.json`` and ``docs/architectures.md`` is written from it.

    python bench/survey_architectures.py --enumerate --fresh     # the whole library, one job (~40 min, loaded machine)
    python bench/survey_architectures.py --enumerate --retry     # again the ones not built, hung or died
    python bench/survey_architectures.py --enumerate --only gpt2,t5 --modes bk
    python bench/survey_architectures.py --enumerate --render    # the page again from the records

The fixed list (issue 36): book-keeping's per-example norms and clipped sums against one
backward pass per example, on tiny Hugging Face models of 24 architectures and a held-out set (built
from configs, no download), in float64 at T != B and T = B, with LoRA, and under bf16 autocast; and
``idpsgd finetune`` on a saved folder of each (``--finetune``).

Prints a markdown table: each cell ``exact``, ``refused: <the engine's error>``, ``crash: <an error from
PyTorch, Opacus or transformers>``, ``WRONG (<relative errors>)`` (a silent misattribution) or
``error: <the harness>``.  The harness is ``tests/hf_architectures.py`` (``python
tests/hf_architectures.py`` runs this script); the tests of the same cases
``tests/test_hf_architectures.py``.

    python bench/survey_architectures.py                 # every architecture, every column (about a minute)
    python bench/survey_architectures.py t5 opt --columns T=B
    python bench/survey_architectures.py --finetune      # the finetune table (a few seconds per architecture)
"""

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import hf_architectures as hf

RECORDS = ROOT / "bench" / "results" / "architectures"  # one record per (type, task), the resumable cache
RESULTS = ROOT / "bench" / "results" / "architectures.json"  # every record merged, with the versions
PAGE = ROOT / "docs" / "architectures.md"


def _redo(path: Path, retry: bool) -> bool:
    """Whether the architecture of the record ``path`` is to be run: no record yet, or (``retry``) one that was
    not built or whose process hung or died."""
    if not path.exists():
        return True
    if not retry:
        return False
    record = json.loads(path.read_text())
    details = [c.get("detail", "") for v in record["conditions"].values() if v for c in v.get("cells", {}).values()]
    return "not_built" in record or any(d.startswith(("timeout:", "signal:", "exit ")) for d in details)


def enumerate_survey(args) -> int:
    """Run every (type, task) not yet recorded (all with ``--fresh``), ``args.jobs`` at a time; merge; render."""
    import hf_enumeration as en
    from idpsgd.io import atomic_open, write_json

    hf._tf()
    todo = en.architectures(tuple(args.tasks.split(",")))
    if args.only:
        wanted = set(args.only.split(","))
        todo = [a for a in todo if a[0] in wanted]
    modes = tuple(args.modes.split(","))
    start = time.perf_counter()
    pending = [a for a in todo if args.fresh or _redo(RECORDS / f"{en.key(*a[:2])}.json", args.retry)]
    if not args.render and pending:
        en.warm_up()
        running: dict = {}
        done = len(todo) - len(pending)
        while pending or running:
            while pending and len(running) < args.jobs:
                arch = pending.pop(0)
                path = RECORDS / f"{en.key(*arch[:2])}.json"
                running[en.start(path, None, (*arch, modes))] = (arch, path, time.perf_counter())
            time.sleep(0.05)
            for proc, (arch, path, t0) in list(running.items()):
                rec = en.finish(proc, path, t0, args.timeout, arch, modes)
                if rec is None:
                    continue
                del running[proc]
                done += 1
                marks = " ".join(en.outcome(rec, m)[0].split(",")[0] for m in modes)
                print(
                    f"[{done}/{len(todo)}] {arch[0]} ({arch[1]}) {time.perf_counter() - t0:.1f} s: {marks}", flush=True
                )
    everything = en.architectures(tuple(en.TASKS))
    records = [
        json.loads(p.read_text()) for p in (RECORDS / f"{en.key(*a[:2])}.json" for a in everything) if p.exists()
    ]
    if (args.only or args.tasks != ",".join(en.TASKS)) and not args.render:
        print(f"{time.perf_counter() - start:.0f} s; a partial run: {RESULTS.name} and the page left as they are")
        return 0
    import opacus
    import torch
    import transformers

    versions = {
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "opacus": opacus.__version__,
    }
    wall = sum(r.get("seconds", 0) for r in records)
    results = {"versions": versions, "wall_s": round(wall), "enumerated": len(everything), "records": records}
    write_json(RESULTS, results)
    with atomic_open(PAGE) as fh:
        fh.write(en.render(results))
    s = en.summary(records)
    print(json.dumps(s["counts"], indent=1))
    print(f"{time.perf_counter() - start:.0f} s (the records' own time: {wall:.0f} s); wrote {RESULTS} and {PAGE}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"architectures (default: all): {', '.join(hf.ALL)}")
    parser.add_argument(
        "--columns", default=",".join(hf.COLUMNS), help="comma-separated subset of " + ",".join(hf.COLUMNS)
    )
    parser.add_argument("--finetune", action="store_true", help="the idpsgd finetune table instead")
    group = parser.add_argument_group("the survey by enumeration (issue 47)")
    group.add_argument("--enumerate", action="store_true", help="every architecture of transformers' auto mappings")
    group.add_argument("--only", default="", help="comma-separated model types (default: all)")
    group.add_argument("--tasks", default="causal-lm,seq-cls,seq2seq,image-cls,audio-cls", help="comma-separated tasks")
    group.add_argument("--modes", default=",".join(hf.MODES), help="comma-separated modes")
    group.add_argument("--jobs", type=int, default=1, help="architectures at a time (default 1)")
    group.add_argument("--timeout", type=float, default=300.0, help="seconds per architecture (default 300)")
    group.add_argument("--fresh", action="store_true", help="recompute the recorded architectures too")
    group.add_argument("--retry", action="store_true", help="recompute the records not built, hung or died")
    group.add_argument("--render", action="store_true", help="only merge the records and write the page")
    args = parser.parse_args(argv)
    if args.enumerate:
        return enumerate_survey(args)
    unknown = sorted(set(args.names) - set(hf.ALL)) + sorted(set(args.columns.split(",")) - set(hf.COLUMNS))
    if unknown:
        parser.error(f"unknown architecture(s) or column(s): {', '.join(unknown)}")
    start = time.perf_counter()
    if args.finetune:
        hf.finetune_survey(args.names or None)
    else:
        hf.survey(args.names or None, tuple(args.columns.split(",")))
    print(
        f"\n{time.perf_counter() - start:.0f} s; tolerance {hf.TOL_FLOAT64:g} relative (float64), "
        f"{hf.TOL_BF16:g} (bf16 autocast against float32)"
    )


if __name__ == "__main__":
    main()
