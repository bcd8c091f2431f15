"""A CNN on image files with two privacy groups: half of the people chose ε = 1, half ε = 3.

The images are MNIST-format files in one folder, the layout ``idpsgd.data`` reads for
``--dataset mnist`` and ``fashion-mnist`` (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally ``.gz``); ``--dataset
cifar10`` reads CIFAR-10's python batches the same way. Training is IDP-SGD *Sample* (Boenisch et
al. 2023) through the harness behind ``idpsgd train``: the run folder gets the public report
(``report.json``, ``report.html``, ``model.pt``) and the private files under ``private/``.

    python examples/cnn_image_files.py --data-dir ~/data/mnist --out runs/cnn
    python examples/cnn_image_files.py --tiny       # makes a tiny MNIST-format set first (seconds)

``--tiny`` (or the environment variable ``IDPSGD_EXAMPLE_TINY=1``) writes 200 synthetic 28×28
images to ``OUT/tiny-images`` (unless ``--data-dir`` is given) and trains one short epoch.
"""

from __future__ import annotations

import argparse
import gzip
import os
import struct
from pathlib import Path

import numpy as np

from idpsgd import Budgets, TrainConfig, load_dataset, train


def write_idx(path: Path, array: np.ndarray) -> None:
    """An unsigned-byte IDX file (LeCun's MNIST format), gzipped."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def make_tiny_images(folder: Path, n_train: int = 200, n_test: int = 100, seed: int = 0) -> Path:
    """Synthetic MNIST-format digits: class k is a bright bar at row 2 + 2k, plus noise."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = np.arange(n) % 10
        images = rng.integers(0, 60, (n, 28, 28))
        for i, k in enumerate(labels):
            images[i, 2 + 2 * k : 4 + 2 * k, 4:24] = 255
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return folder


def main() -> None:
    tiny_default = os.environ.get("IDPSGD_EXAMPLE_TINY") == "1"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", type=Path, help="folder with the image files")
    p.add_argument("--dataset", default="mnist", choices=["mnist", "fashion-mnist", "cifar10"])
    p.add_argument("--out", type=Path, default=Path("runs/cnn_image_files"))
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--tiny", action="store_true", default=tiny_default, help="tiny synthetic data, one short epoch")
    args = p.parse_args()
    if args.data_dir is None and not args.tiny:
        p.error("--data-dir is required (or --tiny for a synthetic set)")
    data_dir = args.data_dir or make_tiny_images(args.out / "tiny-images")

    data = load_dataset(args.dataset, data_dir)  # pixels to [0, 1], then the dataset's public mean/std
    n = len(data.y_train)
    budgets = Budgets.from_groups([1.0, 3.0], [0.5, 0.5], n, delta=1e-5, seed=0)
    config = TrainConfig(
        method="sample",
        epochs=1 if args.tiny else args.epochs,
        batch_size=32 if args.tiny else 256,
        lr=0.05,
        clip_norm=1.0,
        seed=0,
        progress=not args.tiny,
    )
    run = args.out / "run"
    report = train(data, budgets, config, run, overwrite=True)

    print(f"test accuracy {report['test_accuracy']:.3f} after {report['steps']} steps ({report['model']})")
    for g in report["groups"]:
        print(
            f"budget {g['budget']:g}: {g['count']} examples, sampled at q = {g['sample_rate']:.3f}, "
            f"epsilon spent {g['epsilon_spent']:.3f}"
        )
    print(f"report: {run / 'report.html'}")


if __name__ == "__main__":
    main()
