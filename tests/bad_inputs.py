"""The bad-input table of ``tests/test_bad_input.py`` (issue 17): data, so that it grows.

Each case is ``(command, arguments, needle)``:

* ``command`` — the CLI command; its :data:`BASE` arguments (a valid call) come first, then
  ``arguments``, so a later flag overrides the base's (argparse keeps the last value).  A command
  written ``"!train"`` gets no base arguments (e.g. to leave out a required flag).
* ``arguments`` — as typed in a shell (``shlex``); ``{tmp}`` is the test's temporary folder, where
  :func:`make_files` has built the small good and bad input files named below.
* ``needle`` — must appear in the single stderr line: the flag as the user typed it, and its value
  (``--lr=-1`` matches ``--lr=-1.0 is invalid: ...``); quotes are ignored (``--points='1.5'`` matches
  ``--points=1.5``).

Every case must exit with code 2, print exactly one line on stderr, no traceback, and stop before any
training step.  Commands that do not exist (yet) are skipped.
"""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np

BASE = {
    "epsilon": "--sample-rate 0.01 --noise-multiplier 1 --steps 10 --delta 1e-5",
    "noise-multiplier": "--epsilon 1 --sample-rate 0.01 --steps 100 --delta 1e-5",
    "assign": "--method sample --budgets 1,2 --fractions 0.5,0.5 --delta 1e-5 --sample-rate 0.01 --steps 100 "
    "--clip-norm 1",
    "account": "--norms {tmp}/norms.npz --sample-rate 0.01 --noise-multiplier 1 --clip-norm 1 --delta 1e-5 "
    "--out {tmp}/acc --overwrite",
    "train": "--method sample --budgets 1,2 --fractions 0.5,0.5 --epochs 1 --out {tmp}/run --no-progress",
    "demo": "--epochs 1 --out {tmp}/demo --no-progress",
    "per-instance": "--points 0,1 --runs 1 --epochs 1 --out {tmp}/pi --no-progress",
    "reproduce": "heo-table1 --seeds 1 --epochs 1 --out {tmp}/rep --no-progress --no-figures",
    "report": "",
    "audit": "--method sample --budgets 1,2 --fractions 0.5,0.5 --epochs 1 --out {tmp}/aud --no-progress",
    "finetune": "--model {tmp}/hf_model --data {tmp}/texts.jsonl --method scale --epochs 1 --out {tmp}/ft",
}

CSV = "--dataset csv --num-classes 3 --data-dir {tmp}/"

CASES = [
    # --- unknown command / flag ---------------------------------------------------------------
    ("!", "frobnicate", "'frobnicate'"),
    ("epsilon", "--frobnicate 1", "--frobnicate"),
    ("train", "--lr", "--lr"),  # flag without its value
    # --- epsilon ------------------------------------------------------------------------------
    ("epsilon", "--sample-rate 0", "--sample-rate=0"),
    ("epsilon", "--sample-rate -0.1", "--sample-rate=-0.1"),
    ("epsilon", "--sample-rate=-0.1", "--sample-rate=-0.1"),
    ("epsilon", "--sample-rate 1.5", "--sample-rate=1.5"),
    ("epsilon", "--sample-rate nan", "--sample-rate=nan"),
    ("epsilon", "--sample-rate inf", "--sample-rate=inf"),
    ("epsilon", "--sample-rate abc", "--sample-rate='abc'"),
    ("epsilon", "--sample-rate -1e-3", "--sample-rate=-0.001"),
    ("epsilon", "--noise-multiplier 0", "--noise-multiplier=0"),
    ("epsilon", "--noise-multiplier -1", "--noise-multiplier=-1"),
    ("epsilon", "--noise-multiplier nan", "--noise-multiplier=nan"),
    ("epsilon", "--noise-multiplier inf", "--noise-multiplier=inf"),
    ("epsilon", "--noise-multiplier 1e-300", "--noise-multiplier=1e-300"),
    ("epsilon", "--steps 0", "--steps=0"),
    ("epsilon", "--steps -5", "--steps=-5"),
    ("epsilon", "--steps 1.5", "--steps='1.5'"),
    ("epsilon", "--steps abc", "--steps='abc'"),
    ("epsilon", "--delta 0", "--delta=0"),
    ("epsilon", "--delta 1", "--delta=1"),
    ("epsilon", "--delta 1.5", "--delta=1.5"),
    ("epsilon", "--delta -1e-5", "--delta=-1e-05"),
    ("epsilon", "--delta nan", "--delta=nan"),
    ("epsilon", "--accountant foo", "--accountant='foo'"),
    ("epsilon", "--accountant pld --sample-rate 1 --noise-multiplier 0.001 --steps 100", "--noise-multiplier"),
    ("epsilon", "--accountant pld --steps 1000000000000", "--steps=1000000000000"),
    ("!epsilon", "--sample-rate 0.01 --steps 10 --delta 1e-5", "--noise-multiplier"),
    # --- noise-multiplier ---------------------------------------------------------------------
    ("noise-multiplier", "--epsilon 0", "--epsilon=0"),
    ("noise-multiplier", "--epsilon -1", "--epsilon=-1"),
    ("noise-multiplier", "--epsilon nan", "--epsilon=nan"),
    ("noise-multiplier", "--epsilon inf", "--epsilon=inf"),
    ("noise-multiplier", "--epsilon abc", "--epsilon='abc'"),
    ("noise-multiplier", "--epsilon 1e6", "--epsilon=1e+06"),  # unreachable: σ would be < the bracket
    ("noise-multiplier", "--epsilon 1e-9", "--epsilon=1e-09"),  # unreachable (σ explodes)
    ("noise-multiplier", "--epsilon 1e-9 --accountant pld", "--epsilon=1e-09"),
    ("noise-multiplier", "--sample-rate 0", "--sample-rate=0"),
    ("noise-multiplier", "--sample-rate 2", "--sample-rate=2"),
    ("noise-multiplier", "--steps 0", "--steps=0"),
    ("noise-multiplier", "--delta 1", "--delta=1"),
    ("noise-multiplier", "--delta 0", "--delta=0"),
    # --- assign -------------------------------------------------------------------------------
    ("assign", "--method foo", "--method='foo'"),
    ("assign", "--budgets 0,2", "--budgets=0"),
    ("assign", "--budgets -1,2", "--budgets=-1"),
    ("assign", "--budgets=-1,2", "--budgets=-1"),
    ("assign", "--budgets nan,2", "--budgets=nan"),
    ("assign", "--budgets inf,2", "--budgets=inf"),
    ("assign", "--budgets 1,1", "--budgets=1"),
    ("assign", "--budgets a,b", "--budgets='a,b'"),
    ("assign", "--budgets ''", "--budgets"),
    ("assign", "--budgets 1,2,3", "--fractions=0.5,0.5"),  # mismatched lengths
    ("assign", "--fractions 0.5,0.6", "--fractions=0.5,0.6"),
    ("assign", "--fractions 0.5", "--fractions=0.5"),
    ("assign", "--fractions 1.5,-0.5", "--fractions=1.5,-0.5"),
    ("assign", "--fractions=1.5,-0.5", "--fractions=1.5,-0.5"),
    ("assign", "--fractions nan,0.5", "--fractions=nan,0.5"),
    ("assign", "--fractions 0,1", "--fractions=0,1"),  # as typed
    (
        "!assign",
        "--method sample --budgets 1,2 --delta 1e-5 --sample-rate 0.01 --steps 100 --clip-norm 1",
        "--fractions",
    ),
    ("assign", "--delta 1", "--delta=1"),
    ("assign", "--delta 0", "--delta=0"),
    ("assign", "--delta nan", "--delta=nan"),
    ("assign", "--sample-rate 0", "--sample-rate=0"),
    ("assign", "--sample-rate 1.5", "--sample-rate=1.5"),
    ("assign", "--sample-rate nan", "--sample-rate=nan"),
    ("assign", "--steps 0", "--steps=0"),
    ("assign", "--steps -1", "--steps=-1"),
    ("assign", "--clip-norm 0", "--clip-norm=0"),
    ("assign", "--clip-norm -1", "--clip-norm=-1"),
    ("assign", "--clip-norm nan", "--clip-norm=nan"),
    ("assign", "--clip-norm inf", "--clip-norm=inf"),
    ("assign", "--num-examples 0", "--num-examples=0"),
    ("assign", "--num-examples -3", "--num-examples=-3"),
    ("assign", "--num-examples 1.5", "--num-examples='1.5'"),
    ("assign", "--budgets 1,2,3 --fractions 0.3,0.3,0.4 --num-examples 2", "--num-examples=2"),
    ("assign", "--budgets 1e-6,2", "--budgets"),  # unreachable ε
    ("assign", "--budgets-file {tmp}/missing.csv", "--budgets-file={tmp}/missing.csv"),
    ("assign", "--budgets-file {tmp}/empty.csv", "--budgets-file={tmp}/empty.csv"),
    ("assign", "--budgets-file {tmp}/header_only.csv", "--budgets-file='{tmp}/header_only.csv'"),
    ("assign", "--budgets-file {tmp}/nan_budget.csv", "--budgets-file='{tmp}/nan_budget.csv'"),
    ("assign", "--budgets-file {tmp}/negative_budget.csv", "--budgets-file='{tmp}/negative_budget.csv'"),
    ("assign", "--budgets-file {tmp}/text_budget.csv", "--budgets-file='{tmp}/text_budget.csv'"),
    ("assign", "--budgets-file {tmp}/missing_field.csv", "--budgets-file='{tmp}/missing_field.csv'"),
    ("assign", "--budgets-file {tmp}/latin1.csv", "--budgets-file='{tmp}/latin1.csv'"),
    ("assign", "--budgets-file {tmp}/budgets.csv --budget-column foo", "--budget-column='foo'"),
    ("assign", "--budgets-file {tmp}", "--budgets-file={tmp}"),  # a folder
    ("assign", "--budget-distribution exponential --num-examples 100 --range 1", "--range='1'"),
    ("assign", "--budget-distribution exponential --num-examples 100 --range 2,1", "--range"),
    ("assign", "--budget-distribution exponential --num-examples 100 --range 0,1", "--range"),
    ("assign", "--budget-distribution exponential --num-examples 100 --range a,b", "--range='a,b'"),
    ("assign", "--budget-distribution exponential --num-examples 100 --range 0.5,1 --skew nan", "--skew=nan"),
    ("assign", "--budget-distribution exponential --num-examples 100 --range 0.5,1 --skew inf", "--skew=inf"),
    ("assign", "--budget-distribution gaussian", "--budget-distribution='gaussian'"),
    ("assign", "--budgets-per-class 0:1", "--budgets-per-class='0:1'"),
    ("assign", "--accountant foo", "--accountant='foo'"),
    ("assign", "--num-examples 100 --seed -1", "--seed=-1"),
    ("assign", "--seed abc", "--seed='abc'"),
    # --- account ------------------------------------------------------------------------------
    ("account", "--norms {tmp}/missing.npz", "--norms={tmp}/missing.npz"),
    ("account", "--norms {tmp}/empty.npz", "--norms='{tmp}/empty.npz'"),
    ("account", "--norms {tmp}/text.npz", "--norms='{tmp}/text.npz'"),
    ("account", "--norms {tmp}/truncated.npz", "--norms='{tmp}/truncated.npz'"),
    ("account", "--norms {tmp}/no_steps.npz", "--norms='{tmp}/no_steps.npz'"),
    ("account", "--norms {tmp}/string_norms.npz", "--norms='{tmp}/string_norms.npz'"),
    ("account", "--norms {tmp}/nan_norms.npz", "--norms='{tmp}/nan_norms.npz'"),
    ("account", "--norms {tmp}/negative_norms.npz", "--norms='{tmp}/negative_norms.npz'"),
    ("account", "--norms {tmp}/steps_mismatch.npz", "--norms='{tmp}/steps_mismatch.npz'"),
    ("account", "--norms {tmp}/zero_steps.npz", "--norms='{tmp}/zero_steps.npz'"),
    ("account", "--norms {tmp}/norms_3d.npz", "--norms='{tmp}/norms_3d.npz'"),
    ("account", "--norms {tmp}/pickled.npz", "--norms='{tmp}/pickled.npz'"),
    ("account", "--norms {tmp}", "--norms={tmp}"),  # a folder
    ("account", "--sample-rate 0", "--sample-rate=0"),
    ("account", "--sample-rate 1.5", "--sample-rate=1.5"),
    ("account", "--noise-multiplier 0", "--noise-multiplier=0"),
    ("account", "--noise-multiplier nan", "--noise-multiplier=nan"),
    ("account", "--noise-multiplier 1e-300", "--noise-multiplier=1e-300"),
    ("account", "--clip-norm 0", "--clip-norm=0"),
    ("account", "--clip-norm -1", "--clip-norm=-1"),
    ("account", "--delta 0", "--delta=0"),
    ("account", "--delta 1", "--delta=1"),
    ("account", "--rounding foo", "--rounding='foo'"),
    ("account", "--rounding-step 0", "--rounding-step=0"),
    ("account", "--rounding-step -1", "--rounding-step=-1"),
    ("account", "--rounding-step nan", "--rounding-step=nan"),
    ("account", "--rounding-step 1e-12", "--rounding-step=1e-12"),
    ("account", "--accountant pld --rounding exact", "--rounding='exact'"),
    ("account", "--out {tmp}/afile", "--out='{tmp}/afile'"),
    ("account", "--out {tmp}/afile/sub", "--out='{tmp}/afile/sub'"),
    ("account", "--out ''", "--out=''"),
    ("!account", "--norms {tmp}/norms.npz --delta 1e-5 --out {tmp}/acc2", "--sample-rate"),
    # --- train: hyperparameters ---------------------------------------------------------------
    ("train", "--epochs 0", "--epochs=0"),
    ("train", "--epochs -1", "--epochs=-1"),
    ("train", "--epochs 1.5", "--epochs='1.5'"),
    ("train", "--epochs abc", "--epochs='abc'"),
    ("train", "--batch-size 0", "--batch-size=0"),
    ("train", "--batch-size -1", "--batch-size=-1"),
    ("train", "--batch-size 100000", "--batch-size=100000"),
    ("train", "--lr 0", "--lr=0"),
    ("train", "--lr -1", "--lr=-1"),
    ("train", "--lr=-1", "--lr=-1"),
    ("train", "--lr -1e-3", "--lr=-0.001"),
    ("train", "--lr nan", "--lr=nan"),
    ("train", "--lr inf", "--lr=inf"),
    ("train", "--lr 1e308", "--lr=1e+308"),
    ("train", "--momentum -0.1", "--momentum=-0.1"),
    ("train", "--momentum 1", "--momentum=1"),
    ("train", "--momentum nan", "--momentum=nan"),
    ("train", "--clip-norm 0", "--clip-norm=0"),
    ("train", "--clip-norm -1", "--clip-norm=-1"),
    ("train", "--clip-norm nan", "--clip-norm=nan"),
    ("train", "--clip-norm inf", "--clip-norm=inf"),
    ("train", "--delta 0", "--delta=0"),
    ("train", "--delta 1", "--delta=1"),
    ("train", "--delta 1.5", "--delta=1.5"),
    ("train", "--method foo", "--method='foo'"),
    ("train", "--method exclude --exclude-below 0", "--exclude-below=0"),
    ("train", "--method exclude --exclude-below nan", "--exclude-below=nan"),
    ("train", "--model foo", "--model='foo'"),
    ("train", "--model heo_svhn", "--model='heo_svhn'"),  # too big for 8x8 images
    ("train", "--device foo", "--device='foo'"),
    ("train", "--grad-sample-mode foo", "--grad-sample-mode='foo'"),
    ("train", "--accountant foo", "--accountant='foo'"),
    ("train", "--release-epsilon 0", "--release-epsilon=0"),
    ("train", "--release-epsilon -1", "--release-epsilon=-1"),
    ("train", "--release-epsilon nan", "--release-epsilon=nan"),
    ("train", "--seed -1", "--seed=-1"),
    ("train", "--seed abc", "--seed='abc'"),
    ("train", "--seed 1.5", "--seed='1.5'"),
    ("train", "--secure-mode --seed 1", "--seed=1"),
    # --- train: budgets -----------------------------------------------------------------------
    ("train", "--budgets 0,2", "--budgets=0"),
    ("train", "--budgets -1,2", "--budgets=-1"),
    ("train", "--budgets nan,2", "--budgets=nan"),
    ("train", "--fractions 0.5,0.6", "--fractions=0.5,0.6"),
    ("train", "--fractions 0.2,0.3,0.5", "--fractions=0.2,0.3,0.5"),
    ("train", "--budgets 1e-9,2", "--budgets"),  # unreachable ε
    ("!train", "--method sample --epochs 1 --out {tmp}/run", "--budgets"),
    ("train", "--budgets-file {tmp}/budgets.csv", "--budgets-file='{tmp}/budgets.csv'"),  # wrong row count
    ("train", "--budgets-file {tmp}/empty.csv", "--budgets-file={tmp}/empty.csv"),
    ("train", "--budgets-file {tmp}/nan_budget.csv", "--budgets-file='{tmp}/nan_budget.csv'"),
    ("train", "--budgets-file {tmp}/missing.csv", "--budgets-file={tmp}/missing.csv"),
    ("train", "--budgets-per-class 0:1", "--budgets-per-class='0:1'"),  # classes 1..9 missing
    ("train", "--budgets-per-class 0:x", "--budgets-per-class='0:x'"),
    ("train", "--budgets-per-class 0:-1,1:1,2:1,3:1,4:1,5:1,6:1,7:1,8:1,9:1", "--budgets-per-class"),
    ("train", "--budgets-per-class 0:1,1:1,2:1,3:1,4:1,5:1,6:1,7:1,8:1,9:1,11:2", "outside the public classes"),
    ("train", "--budget-distribution exponential --range 0.5", "--range='0.5'"),
    ("train", "--budget-distribution exponential --range 0.5,1 --skew nan", "--skew=nan"),
    # --- train: data --------------------------------------------------------------------------
    ("train", "--dataset foo", "--dataset='foo'"),
    ("train", "--dataset mnist", "--data-dir"),
    ("train", "--dataset mnist --data-dir {tmp}/nowhere", "--data-dir={tmp}/nowhere"),
    ("train", "--data-dir {tmp}", "--data-dir='{tmp}'"),  # digits is bundled
    ("train", "--label-column y", "--label-column='y'"),  # only for csv
    ("train", "--dataset csv --data-dir {tmp}/csv_good", "--num-classes is required"),  # no public default for csv
    ("train", "--dataset csv --num-classes 1 --data-dir {tmp}/csv_good", "--num-classes=1"),
    ("train", "--num-classes 3", "--num-classes=3"),  # digits has 10 classes
    # a label outside --num-classes: a per-row error, never a new class
    ("train", "--dataset csv --num-classes 2 --data-dir {tmp}/csv_one_member_class", "line 12, column 'label'"),
    ("train", CSV + "csv_ragged", "--data-dir={tmp}/csv_ragged"),
    ("train", CSV + "csv_one_row", "--data-dir={tmp}/csv_one_row"),
    ("train", CSV + "csv_nan_feature", "--data-dir={tmp}/csv_nan_feature"),
    ("train", CSV + "csv_fractional_label", "--data-dir={tmp}/csv_fractional_label"),
    ("train", CSV + "csv_test_other_columns", "--data-dir={tmp}/csv_test_other_columns"),
    ("train", CSV + "csv_empty", "--data-dir={tmp}/csv_empty"),
    ("train", CSV + "csv_latin1", "--data-dir={tmp}/csv_latin1"),
    ("train", CSV + "csv_no_train", "--data-dir={tmp}/csv_no_train"),
    ("train", CSV + "csv_good --label-column y", "--data-dir={tmp}/csv_good"),
    ("train", CSV + "csv_good --feature-columns a,zz", "--feature-columns='a,zz'"),  # no column zz
    ("train", CSV + "csv_good --feature-columns a,label", "--feature-columns='a,label'"),  # the label
    ("train", CSV + "csv_good --feature-columns a,,b", "--feature-columns='a,,b'"),  # an empty name
    ("train", CSV + "csv_good --feature-columns a,a", "--feature-columns='a,a'"),  # twice
    ("train", CSV + "csv_good --drop-columns zz", "--drop-columns='zz'"),
    ("train", CSV + "csv_good --drop-columns label", "--drop-columns='label'"),
    ("train", CSV + "csv_good --feature-columns a --drop-columns b", "--drop-columns='b'"),  # not both
    ("train", "--feature-columns a", "--feature-columns='a'"),  # only for csv
    ("train", "--drop-columns a", "--drop-columns='a'"),  # only for csv
    ("train", CSV + "csv_text_cell", "--data-dir={tmp}/csv_text_cell"),
    ("train", "--dataset mnist --data-dir {tmp}/mnist_label_10", "--data-dir={tmp}/mnist_label_10"),
    ("train", "--dataset mnist --data-dir {tmp}/mnist_truncated", "--data-dir={tmp}/mnist_truncated"),
    ("train", "--dataset fashion-mnist --data-dir {tmp}/mnist_empty", "--data-dir={tmp}/mnist_empty"),
    ("train", "--dataset cifar10 --data-dir {tmp}/cifar_garbage", "--data-dir={tmp}/cifar_garbage"),
    ("train", "--dataset cifar10 --data-dir {tmp}/cifar_crafted", "--data-dir={tmp}/cifar_crafted"),
    ("train", "--dataset svhn --data-dir {tmp}/svhn_garbage", "--data-dir={tmp}/svhn_garbage"),
    # --- train: normalization -----------------------------------------------------------------
    ("train", "--normalization foo", "--normalization='foo'"),
    ("train", "--normalization 0.5,0", "--normalization='0.5,0'"),
    ("train", "--normalization 0.5,nan", "--normalization='0.5,nan'"),
    ("train", "--normalization private", "--normalization-epsilon"),
    (
        "train",
        "--normalization private --normalization-epsilon 0 --normalization-delta 1e-6",
        "--normalization-epsilon=0",
    ),
    ("train", "--normalization private --normalization-epsilon 0.1 --normalization-delta 1", "--normalization-delta=1"),
    ("train", "--normalization-epsilon 0.1", "--normalization-epsilon=0.1"),  # without private
    (
        "train",
        CSV + "csv_good --normalization private --normalization-epsilon 0.1 --normalization-delta 1e-6 "
        "--feature-range 1,0",
        "--feature-range='1,0'",
    ),
    # --- train: output folder and resume ------------------------------------------------------
    ("train", "--out {tmp}/afile", "--out='{tmp}/afile'"),
    ("train", "--out {tmp}/afile/sub", "--out='{tmp}/afile/sub'"),
    ("train", "--out ''", "--out=''"),
    ("train", "--out {tmp}/old_run", "--out='{tmp}/old_run'"),  # another run's folder
    ("train", "--out {tmp}/ckpt_garbage --resume", "checkpoint.pt"),
    ("train", "--out {tmp}/ckpt_empty --resume", "checkpoint.pt"),
    ("train", "--out {tmp}/ckpt_foreign --resume", "checkpoint.pt"),
    ("train", "--out {tmp}/ckpt_crafted --resume", "checkpoint.pt"),
    # --- train: PDP-SGD and baselines ---------------------------------------------------------
    ("train", "--method pdp-sgd --batch-size 0", "--batch-size=0"),
    ("train", "--method pdp-sgd --epochs 0", "--epochs=0"),
    ("train", "--method pdp-sgd --rounds 0", "--rounds=0"),
    ("train", "--method pdp-sgd --rounds -1", "--rounds=-1"),
    ("train", "--method pdp-sgd --w1 1.5", "--w1=1.5"),
    ("train", "--method pdp-sgd --w1 -0.1", "--w1=-0.1"),
    ("train", "--method pdp-sgd --w1 nan", "--w1=nan"),
    ("train", "--method pdp-sgd --threshold-loss foo", "--threshold-loss='foo'"),
    ("train", "--method pdp-sgd --clip-norm 0", "--clip-norm=0"),
    ("train", "--method pdp-sgd --lr -1", "--lr=-1"),
    ("train", "--method pdp-sgd --resume", "--resume"),
    ("train", "--method adapdp --rounds 0", "--rounds=0"),
    # --- train: individual accounting and the filter ------------------------------------------
    ("train", "--save-norms", "--save-norms"),
    ("train", "--individual-clipping", "--individual-clipping"),
    ("train", "--individual-accounting --refreshes-per-epoch 0", "--refreshes-per-epoch=0"),
    ("train", "--individual-accounting --refreshes-per-epoch nan", "--refreshes-per-epoch=nan"),
    ("train", "--individual-accounting --rounding-step 0", "--rounding-step=0"),
    ("train", "--individual-accounting --rounding-step 1e-12", "--rounding-step=1e-12"),
    ("train", "--individual-accounting --validate-subset -1", "--validate-subset=-1"),
    ("train", "--individual-accounting --rounding foo", "--rounding='foo'"),
    ("train", "--individual-accounting --method sequential", "--method='sequential'"),
    ("train", "--filter-order 0.5", "--filter-order=0.5"),
    ("train", "--filter individual --filter-order 0.5", "--filter-order=0.5"),
    ("train", "--filter individual --filter-extend 0.5", "--filter-extend=0.5"),
    ("train", "--filter individual --accountant pld", "--accountant='pld'"),
    ("train", "--filter foo", "--filter='foo'"),
    # --- demo ---------------------------------------------------------------------------------
    ("demo", "--seed -1", "--seed=-1"),
    ("demo", "--seed abc", "--seed='abc'"),
    ("demo", "--epochs 0", "--epochs=0"),
    ("demo", "--lr -1", "--lr=-1"),
    ("demo", "--lr=-1", "--lr=-1"),
    ("demo", "--batch-size 0", "--batch-size=0"),
    ("demo", "--delta 1", "--delta=1"),
    ("demo", "--clip-norm 0", "--clip-norm=0"),
    ("demo", "--momentum 1", "--momentum=1"),
    ("demo", "--dataset foo", "--dataset='foo'"),
    ("demo", "--out {tmp}/afile", "--out='{tmp}/afile'"),
    ("demo", "--out {tmp}/afile/sub", "--out='{tmp}/afile/sub'"),
    ("demo", "--out ''", "--out=''"),
    ("demo", "--out {tmp}/old_run", "--out='{tmp}/old_run'"),
    ("demo", "--secure-mode --seed 3", "--seed=3"),
    # --- per-instance -------------------------------------------------------------------------
    ("per-instance", "--epsilon 0", "--epsilon=0"),
    ("per-instance", "--epsilon -1", "--epsilon=-1"),
    ("per-instance", "--epsilon nan", "--epsilon=nan"),
    ("per-instance", "--points nan", "--points='nan'"),
    ("per-instance", "--points 1.5", "--points='1.5'"),
    ("per-instance", "--points -1", "--points='-1'"),
    ("per-instance", "--points 99999", "--points='99999'"),
    ("per-instance", "--points a", "--points='a'"),
    ("per-instance", "--points 1,1", "--points='1,1'"),
    ("!per-instance", "--num-points 0 --out {tmp}/pi", "--num-points=0"),
    ("!per-instance", "--num-points 100000 --out {tmp}/pi", "--num-points=100000"),
    ("!per-instance", "--out {tmp}/pi", "--points"),
    ("per-instance", "--runs 0", "--runs=0"),
    ("per-instance", "--runs -1", "--runs=-1"),
    ("per-instance", "--alpha 1", "--alpha=1"),
    ("per-instance", "--alpha 0", "--alpha=0"),
    ("per-instance", "--alpha nan", "--alpha=nan"),
    ("per-instance", "--alpha inf", "--alpha=inf"),
    ("per-instance", "--alpha x", "--alpha='x'"),
    ("per-instance", "--update-rule mean --alpha 2.5", "--alpha=2.5"),  # Thm. 3.6 needs an integer order
    ("per-instance", "--update-rule foo", "--update-rule='foo'"),
    ("per-instance", "--target-set foo", "--target-set='foo'"),
    ("per-instance", "--checkpoint-every 0", "--checkpoint-every=0"),
    ("per-instance", "--checkpoint-every -1", "--checkpoint-every=-1"),
    ("per-instance", "--samples 0,20", "--samples='0,20'"),
    ("per-instance", "--samples 20", "--samples='20'"),
    ("per-instance", "--samples a,b", "--samples='a,b'"),
    ("per-instance", "--samples 1.5,2", "--samples='1.5,2'"),
    ("per-instance", "--p 0.5", "--p=0.5"),
    ("per-instance", "--p nan", "--p=nan"),
    ("per-instance", "--failure 0", "--failure=0"),
    ("per-instance", "--failure 1", "--failure=1"),
    ("per-instance", "--failure 1.5", "--failure=1.5"),
    ("per-instance", "--unlearning-beta 0", "--unlearning-beta=0"),
    ("per-instance", "--unlearning-beta -1", "--unlearning-beta=-1"),
    ("per-instance", "--unlearning-beta nan", "--unlearning-beta=nan"),
    ("per-instance", "--seed -1", "--seed=-1"),
    ("per-instance", "--delta 1", "--delta=1"),
    ("per-instance", "--lr -1", "--lr=-1"),
    ("per-instance", "--out {tmp}/afile", "--out='{tmp}/afile'"),
    ("per-instance", "--out ''", "--out=''"),
    # --- reproduce ----------------------------------------------------------------------------
    ("!reproduce", "foo --out {tmp}/rep", "'foo'"),
    ("reproduce", "--seeds 0", "--seeds=0"),
    ("reproduce", "--seeds -1", "--seeds=-1"),
    ("reproduce", "--epochs 0", "--epochs=0"),
    ("reproduce", "--batch-size 0", "--batch-size=0"),
    ("reproduce", "--lr 0", "--lr=0"),
    ("reproduce", "--lr nan", "--lr=nan"),
    ("reproduce", "--lr -1", "--lr=-1"),
    ("reproduce", "--rounds 0", "--rounds=0"),
    ("reproduce", "--delta 1", "--delta=1"),
    ("reproduce", "--dataset foo", "--dataset='foo'"),
    ("reproduce", "--dataset mnist", "--data-dir"),
    ("reproduce", "--model foo", "--model='foo'"),
    ("reproduce", "--out {tmp}/afile", "--out='{tmp}/afile'"),
    ("reproduce", "--out ''", "--out=''"),
    # boenisch-table2 / boenisch-table3 / yu-figure (issue 25)
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --seeds 0", "--seeds=0"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --setups 50-50", "--setups='50-50'"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --setups 34-43-23,34-43-23", "--setups='34-43-23,34-43-23'"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --epochs 0", "--epochs=0"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --batch-size -1", "--batch-size=-1"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --lr nan", "--lr=nan"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --clip-norm 0", "--clip-norm=0"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --delta 0", "--delta=0"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --device foo", "--device='foo'"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --model foo", "--model='foo'"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --dataset mnist", "--data-dir"),
    ("!reproduce", "boenisch-table2 --out {tmp}/rep --rounds 2", "--rounds"),  # heo-table1's flag only
    ("!reproduce", "boenisch-table3 --out {tmp}/rep --seeds 0", "--seeds=0"),
    ("!reproduce", "boenisch-table3 --out {tmp}/rep --epsilon 0", "--epsilon=0"),
    ("!reproduce", "boenisch-table3 --out {tmp}/rep --epsilon 2 --epsilon-high 1", "--epsilon-high=1"),
    ("!reproduce", "boenisch-table3 --out {tmp}/rep --calibrated-steps 0", "--calibrated-steps=0"),
    ("!reproduce", "boenisch-table3 --out {tmp}/rep --extend -1", "--extend=-1"),
    ("!reproduce", "boenisch-table3 --out {tmp}/rep --momentum 1", "--momentum=1"),
    ("!reproduce", "boenisch-table3 --out {tmp}/rep --lr inf", "--lr=inf"),
    ("!reproduce", "yu-figure --out {tmp}/rep --seeds 0", "--seeds=0"),
    ("!reproduce", "yu-figure --out {tmp}/rep --epsilon -1", "--epsilon=-1"),
    ("!reproduce", "yu-figure --out {tmp}/rep --refreshes-per-epoch 0", "--refreshes-per-epoch=0"),
    ("!reproduce", "yu-figure --out {tmp}/rep --validate-subset -1", "--validate-subset=-1"),
    ("!reproduce", "yu-figure --out {tmp}/rep --release-epsilon 0", "--release-epsilon=0"),
    ("!reproduce", "yu-figure --out {tmp}/rep --class-release-epsilon nan", "--class-release-epsilon=nan"),
    ("!reproduce", "yu-figure --out {tmp}/rep --clip-norm abc", "--clip-norm='abc'"),
    ("!reproduce", "yu-figure --out {tmp}/afile", "--out='{tmp}/afile'"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --seeds 0", "--seeds=0"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --points 0", "--points=0"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --points 100000", "--points=100000"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --epsilons 0", "--epsilons='0'"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --epsilons 1,x", "--epsilons='1,x'"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --alpha 1", "--alpha='1'"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --alpha foo", "--alpha='foo'"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --batch-size 0", "--batch-size=0"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --epochs 0", "--epochs=0"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --lr -1", "--lr=-1"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --momentum 1", "--momentum=1"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --clip-norm 0", "--clip-norm=0"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --delta 1", "--delta=1"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --checkpoint-every 0", "--checkpoint-every=0"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --target-set foo", "--target-set='foo'"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --device foo", "--device='foo'"),
    ("!reproduce", "thudi-figure1 --out {tmp}/rep --dataset mnist", "--data-dir"),
    # --- report -------------------------------------------------------------------------------
    ("report", "{tmp}/nowhere", "{tmp}/nowhere"),
    ("report", "{tmp}/afile", "{tmp}/afile"),
    ("report", "{tmp}/empty_dir", "{tmp}/empty_dir"),
    ("report", "{tmp}/bad_report", "{tmp}/bad_report"),
    ("report", "''", "''"),
    # --- audit (only where the command exists) ------------------------------------------------
    ("audit", "--method foo", "--method='foo'"),
    ("audit", "--seed -1", "--seed=-1"),
    ("audit", "--shadow-models 0", "--shadow-models=0"),
    ("audit", "--confidence 1.5", "--confidence=1.5"),
    ("audit", "--out {tmp}/afile", "--out='{tmp}/afile'"),
    ("audit", "--budgets 0,2", "--budgets=0"),
    ("audit", "--batch-size 1000", "--batch-size=1000"),  # above the expected model's 718.5 examples
    ("audit", "--budgets 0.001,2", "--budgets=0.001"),  # the one plan cannot be calibrated (no folder left)
    # --- finetune (checked before the model is loaded; the model folders are stand-ins) -----------
    ("finetune", "--epochs 0", "--epochs=0"),
    ("finetune", "--epochs nan", "--epochs=nan"),
    ("finetune", "--batch-size 0", "--batch-size=0"),
    ("finetune", "--batch-size 100", "--batch-size=100"),
    ("finetune", "--batch-size 6 --physical-batch-size 4", "--physical-batch-size=4"),
    ("finetune", "--physical-batch-size 0", "--physical-batch-size=0"),
    ("finetune", "--lr -1", "--lr=-1"),
    ("finetune", "--max-grad-norm 0", "--max-grad-norm=0"),
    ("finetune", "--max-length 0", "--max-length=0"),
    ("finetune", "--lora-r -1", "--lora-r=-1"),
    ("finetune", "--weight-decay -1", "--weight-decay=-1"),
    ("finetune", "--delta 0", "--delta=0"),
    ("finetune", "--method exclude", "--method=exclude"),
    ("finetune", "--device tpu", "--device=tpu"),
    ("finetune", "--seed 1 --secure-mode", "--seed=1"),
    ("finetune", "--save-every 0", "--save-every=0"),
    ("finetune", "--nproc 0", "--nproc=0"),
    ("finetune", "--nproc 3", "--batch-size=16 is invalid: must be a multiple of the 3 processes (--nproc"),
    ("!finetune", "--data {tmp}/texts.jsonl --method scale --out {tmp}/ft", "--model"),
    ("finetune", "--model {tmp}/nope", "--model={tmp}/nope"),
    ("finetune", "--model {tmp}/afile", "--model={tmp}/afile"),
    ("finetune", "--model {tmp}/empty_dir", "no config.json"),
    ("finetune", "--model {tmp}/hf_no_weights", "has no weights"),
    ("finetune", "--model {tmp}/hf_no_tokenizer", "has no tokenizer"),
    ("finetune", "--data {tmp}/nope.jsonl", "--data={tmp}/nope.jsonl"),
    ("finetune", "--data {tmp}/afile", "--data={tmp}/afile"),
    ("finetune", "--data {tmp}/budgets.csv", "no column text"),
    ("finetune", "--data {tmp}/texts_bad_json.jsonl", "line 2: not valid JSON"),
    ("finetune", "--data {tmp}/texts_bad_budget.jsonl", "column epsilon: lots is not a budget"),
    ("finetune", "--data {tmp}/texts_empty_text.jsonl", "line 2, column text:   is not a non-empty text"),
    # a budget column named explicitly and another source (unnamed, the --budgets flag wins: issue 48)
    ("finetune", "--data {tmp}/texts.jsonl --budget-column epsilon --budgets 1,2 --fractions 0.5,0.5", "--budgets=1,2"),
    ("finetune", "--data {tmp}/texts_plain.jsonl", "is not a column of --data"),
    ("finetune", "--data {tmp}/texts_plain.jsonl --budgets 1,2", "--fractions are required"),
    ("finetune", "--text-column body", "no column body"),
    ("finetune", "--label-column label", "no column label"),
    ("finetune", "--labels neg", "--labels=neg"),  # one class
    ("finetune", "--labels neg,neg", "--labels=neg,neg"),
    ("finetune", "--num-classes 1", "--num-classes=1"),
    ("finetune", "--labels a,b --num-classes 2", "--num-classes=2"),  # one way, not both
    ("finetune", "--labels a,b", "--labels=a,b"),  # without --label-column
    ("finetune", "--eval-data {tmp}/nope.jsonl", "--eval-data={tmp}/nope.jsonl"),
]


# --- the files the cases read ----------------------------------------------------------------


def _idx(array: np.ndarray) -> bytes:
    a = np.asarray(array, dtype=np.uint8)
    return struct.pack(">HBB", 0, 8, a.ndim) + struct.pack(">" + "I" * a.ndim, *a.shape) + a.tobytes()


def _npz(path: Path, **arrays) -> None:
    with path.open("wb") as fh:
        np.savez(fh, **arrays)


class _RunsCode:
    """Pickles to a call of ``os.system``: a loader that unpickles it would run a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def make_files(tmp: Path) -> Path:
    """Build every file the cases name under ``tmp``; returns the marker path a crafted file would create."""
    marker = tmp / "CODE_RAN"
    text = {
        "afile": "not a folder\n",
        "budgets.csv": "epsilon\n1\n2\n3\n1\n2\n",
        "empty.csv": "",
        "header_only.csv": "epsilon\n",
        "nan_budget.csv": "epsilon\n1\nnan\n2\n",
        "negative_budget.csv": "epsilon\n1\n-2\n",
        "text_budget.csv": "epsilon\n1\nlots\n",
        "missing_field.csv": "id,epsilon\n0,1\n1\n",
        "csv_ragged/train.csv": "a,b,label\n" + "".join(f"{i},{i},{i % 2}\n" for i in range(10)) + "1,2\n",
        "csv_one_member_class/train.csv": "a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(10)) + "5,2\n",
        "csv_one_row/train.csv": "a,label\n1,0\n",
        "csv_nan_feature/train.csv": "a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(10)) + "nan,1\n",
        "csv_fractional_label/train.csv": "a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(10)) + "1,0.5\n",
        "csv_test_other_columns/train.csv": "a,b,label\n" + "".join(f"{i},{i},{i % 2}\n" for i in range(10)),
        "csv_test_other_columns/test.csv": "a,c,label\n" + "".join(f"{i},{i},{i % 2}\n" for i in range(4)),
        "csv_empty/train.csv": "",
        "csv_no_train/test.csv": "a,label\n1,0\n2,1\n",
        "csv_good/train.csv": "a,b,label\n" + "".join(f"{i},{i * i},{i % 2}\n" for i in range(20)),
        "csv_text_cell/train.csv": "a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(10)) + "x,1\n",
        "cifar_garbage/data_batch_1": "garbage",
        "svhn_garbage/train_32x32.mat": "not a mat file",
        "svhn_garbage/test_32x32.mat": "not a mat file",
        "mnist_empty/train-images-idx3-ubyte": "",
        "mnist_empty/train-labels-idx1-ubyte": "",
        "mnist_empty/t10k-images-idx3-ubyte": "",
        "mnist_empty/t10k-labels-idx1-ubyte": "",
        "old_run/report.json": "{}",
        "old_run/outputs.json": '{"files": {"report.json": {"kind": "public", "description": "x"}}}',
        "ckpt_garbage/private/checkpoint.pt": "garbage",
        "ckpt_empty/private/checkpoint.pt": "",
        "empty_dir/.keep": "",
        "bad_report/report.json": "{ not json",
        "text.npz": "not an npz file",
        "hf_model/config.json": "{}",  # stand-ins: the cases stop before loading them
        "hf_model/model.safetensors": "",
        "hf_model/tokenizer.json": "{}",
        "hf_no_weights/config.json": "{}",
        "hf_no_weights/tokenizer.json": "{}",
        "hf_no_tokenizer/config.json": "{}",
        "hf_no_tokenizer/model.safetensors": "",
        "texts.jsonl": "".join(f'{{"text": "a text {i}", "epsilon": {1 + i % 2}}}\n' for i in range(12)),
        "texts_plain.jsonl": "".join(f'{{"text": "a text {i}"}}\n' for i in range(12)),
        "texts_bad_json.jsonl": '{"text": "a", "epsilon": 1}\n{"text": \n',
        "texts_bad_budget.jsonl": '{"text": "a", "epsilon": "lots"}\n',
        "texts_empty_text.jsonl": '{"text": "a", "epsilon": 1}\n{"text": " ", "epsilon": 1}\n',
        "empty.npz": "",
    }
    for name, content in text.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
    (tmp / "latin1.csv").write_bytes("epsilon,note\n1,caf\xe9\n".encode("latin-1"))
    (tmp / "csv_latin1").mkdir()
    (tmp / "csv_latin1/train.csv").write_bytes("a,label\n1,0\n2,1\n3,0\n4,1\n\xe9,0\n".encode("latin-1"))
    for name in ("data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"):
        (tmp / "cifar_garbage" / name).write_text("garbage")
    (tmp / "cifar_crafted").mkdir()
    crafted = pickle.dumps(_RunsCode(marker), protocol=2)
    for name in ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch"):
        (tmp / "cifar_crafted" / name).write_bytes(crafted)
    (tmp / "ckpt_crafted/private").mkdir(parents=True)
    (tmp / "ckpt_crafted/private/checkpoint.pt").write_bytes(crafted)
    import torch

    (tmp / "ckpt_foreign/private").mkdir(parents=True)
    torch.save({"weights": torch.zeros(3)}, tmp / "ckpt_foreign/private/checkpoint.pt")
    # MNIST-like IDX files: labels > 9; truncated images
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 255, (20, 28, 28)), np.arange(20) % 10
    for folder, bad_labels, bad_images in (
        ("mnist_label_10", np.full(20, 10), _idx(images)),
        ("mnist_truncated", labels, _idx(images)[:500]),
    ):
        d = tmp / folder
        d.mkdir()
        (d / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(bad_images))
        (d / "train-labels-idx1-ubyte").write_bytes(_idx(bad_labels))
        (d / "t10k-images-idx3-ubyte").write_bytes(_idx(images))
        (d / "t10k-labels-idx1-ubyte").write_bytes(_idx(labels))
    # norms files for `account`
    good = rng.uniform(0, 2, (2, 10))
    _npz(tmp / "norms.npz", norms=good, steps=np.array([5, 5]))
    (tmp / "truncated.npz").write_bytes((tmp / "norms.npz").read_bytes()[:120])
    _npz(tmp / "no_steps.npz", norms=good)
    _npz(tmp / "string_norms.npz", norms=np.array(["a", "b"]), steps=np.array([1]))
    nan = good.copy()
    nan[1, 3] = np.nan
    _npz(tmp / "nan_norms.npz", norms=nan, steps=np.array([5, 5]))
    _npz(tmp / "negative_norms.npz", norms=-good, steps=np.array([5, 5]))
    _npz(tmp / "steps_mismatch.npz", norms=good, steps=np.array([1, 2, 3]))
    _npz(tmp / "zero_steps.npz", norms=good, steps=np.array([0, 0]))
    _npz(tmp / "norms_3d.npz", norms=np.ones((2, 2, 2)), steps=np.array([1, 1]))
    _npz(tmp / "pickled.npz", norms=np.array([{"a": 1}], dtype=object), steps=np.array([1]))
    return marker
