"""An Opacus 1.6 training script, ported to idpsgd by changing two lines.

This is the shape of Opacus's own tutorials (a CNN, ``make_private_with_epsilon``,
``BatchMemoryManager``, ε printed per epoch) on scikit-learn's 8×8 digits. The two lines marked
``# changed`` are the whole port: the import and the class name. Changed back, the script runs on
Opacus (the test suite runs it both ways). ``--per-class-budgets`` is what idpsgd adds: the
digits 0–4 get ε = 1, the others ``--epsilon``, and each privacy group spends its own budget.

    python examples/opacus_port.py --epochs 20
    python examples/opacus_port.py --tiny       # or IDPSGD_EXAMPLE_TINY=1: one epoch
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from opacus.utils.batch_memory_manager import BatchMemoryManager
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from idpsgd import IndividualizedPrivacyEngine  # changed: from opacus import PrivacyEngine


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.tanh(self.conv1(x)), 2)  # 8x8 -> 4x4
        x = F.max_pool2d(torch.tanh(self.conv2(x)), 2)  # 4x4 -> 2x2
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


def digits(seed: int = 0):
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    train, test = order[:1400], order[1400:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def train(model, optimizer, loader, max_physical_batch_size):
    model.train()
    losses = []
    with BatchMemoryManager(
        data_loader=loader, max_physical_batch_size=max_physical_batch_size, optimizer=optimizer
    ) as memory_safe_loader:
        for images, target in memory_safe_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return float(np.mean(losses)) if losses else float("nan")


def test(model, dataset):
    model.eval()
    with torch.no_grad():
        images, target = dataset.tensors
        return (model(images).argmax(1) == target).float().mean().item()


def main():
    tiny_default = os.environ.get("IDPSGD_EXAMPLE_TINY") == "1"
    parser = argparse.ArgumentParser(description="Opacus-style DP-SGD on digits")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--per-class-budgets", action="store_true", help="idpsgd only: ε = 1 for the digits 0-4")
    parser.add_argument("--tiny", action="store_true", default=tiny_default, help="one epoch")
    args = parser.parse_args()
    epochs = 1 if args.tiny else args.epochs

    torch.manual_seed(0)
    train_set, test_set = digits()
    model = SampleConvNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    extra = {}
    if args.per_class_budgets:  # one budget per example: the privacy groups
        extra["budgets"] = np.where(train_set.tensors[1].numpy() < 5, 1.0, args.epsilon)

    privacy_engine = IndividualizedPrivacyEngine()  # changed: PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(train_set, batch_size=args.batch_size),
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=epochs,
        max_grad_norm=args.max_grad_norm,
        **extra,
    )
    for epoch in range(1, epochs + 1):
        loss = train(model, optimizer, train_loader, max_physical_batch_size=32)
        epsilon = privacy_engine.get_epsilon(args.delta)
        print(f"epoch {epoch}: loss {loss:.3f}, test accuracy {test(model, test_set):.3f}, epsilon {epsilon:.2f}")
    if args.per_class_budgets:  # epsilon above is the loosest group's; per group:
        print(repr(privacy_engine.get_epsilon(args.delta)))


if __name__ == "__main__":
    main()
