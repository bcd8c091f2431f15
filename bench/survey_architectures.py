"""The architecture survey of issue 36: book-keeping's per-example norms and clipped sums against one
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
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import hf_architectures as hf


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"architectures (default: all): {', '.join(hf.ALL)}")
    parser.add_argument(
        "--columns", default=",".join(hf.COLUMNS), help="comma-separated subset of " + ",".join(hf.COLUMNS)
    )
    parser.add_argument("--finetune", action="store_true", help="the idpsgd finetune table instead")
    args = parser.parse_args(argv)
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
