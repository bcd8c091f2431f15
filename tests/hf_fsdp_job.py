"""A private Trainer run sharded with FSDP2, for ``tests/test_fsdp_checkpoints.py``:

    torchrun --nproc-per-node N tests/hf_fsdp_job.py MODEL_DIR OUT

With ``SAVE_STEPS=k`` sharded checkpoints every k steps; ``CRASH_AT=s`` makes rank ``CRASH_RANK``
(default 1) raise at the end of step s; ``RESUME=1`` resumes from the latest checkpoint (privacy
seed None: the checkpoint's).  Rank 0 saves the final parameters, ε and ledger to OUT/result.pt.

The run is ``tests/hf_torchrun_job.py``'s :func:`run` (this script's folder is first on ``sys.path``).
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_torchrun_job import run


def main(model_dir, out):
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    run(tok, model, out, 1, crash_rank=int(os.environ.get("CRASH_RANK", "1")), fsdp=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
