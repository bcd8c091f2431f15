"""Many DP-SGD runs of one architecture trained at once: the runs of the per-instance analysis
(Thudi et al. §3.2.2 "Estimating Theorem 3.3", §4).

Thm. 3.3 needs expectations over training runs on X and on every target's X' = X ∪ {x*}; at the
paper's sampling rate (q ≈ 0.002; on digits an expected batch of 3) a run is thousands of tiny
steps, and one model per process spends its time in per-step overhead.  Here M runs share every
step: their parameters are stacked and every layer runs once for all runs' examples, with
Opacus's per-example gradients (Goodfellow 2015; Rochette et al. 2019: linear g_W = b·aᵀ, never
materialised; convolution B·unfold(A)ᵀ), so each run's clipped sum is exact.  Each run is uniform
DP-SGD (Abadi et al. 2016) as the library's :class:`~idpsgd.training.loop.Trainer` runs it:
Poisson draws at rate q, Opacus's clip factor min(1, C/(‖g‖ + 1e-6)), Gaussian noise σC, the
public normaliser q·N (the same on X and X'), ``torch.optim.SGD`` with momentum.  All runs start
from one initialisation; draws and noise come from two seeded generators (research measurement:
no secure mode).  Architectures: ``nn.Sequential`` of Conv2d, Linear, pooling, Flatten and
element-wise activations (:func:`supports`).  User guide: ``docs/per-instance.md``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..engine.noise.randomness import derive_seed, seeded_generator
from ..validation import InvalidParameterError

#: Element-wise activations (applied to the stacked batch as is).
ACTIVATIONS = (nn.Tanh, nn.ReLU, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Identity)
#: Layers applied per example and channel (on the stacked batch as is).
POOLS = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
#: Largest block of per-example values held at once (floats).
MAX_BLOCK = 2**25


def _layers(model: nn.Module) -> list[nn.Module] | None:
    """The model's layers in order, or None when it is not a plain (nested) ``nn.Sequential`` of supported layers."""
    if not isinstance(model, nn.Sequential):
        return None
    out = []
    for m in model:
        if isinstance(m, nn.Sequential):
            inner = _layers(m)
            if inner is None:
                return None
            out += inner
        elif isinstance(m, nn.Conv2d):
            if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str):
                return None
            out.append(m)
        elif isinstance(m, nn.Flatten) and m.start_dim != 1:
            return None
        elif isinstance(m, (nn.Linear, nn.Flatten, *ACTIVATIONS, *POOLS)):
            out.append(m)
        else:
            return None
    return out


def supports(model: nn.Module) -> bool:
    """True when :class:`ParallelRuns` can train ``model``'s architecture."""
    return _layers(model) is not None


class ParallelRuns:
    """M DP-SGD runs of ``model``'s architecture on subsets of one pool of examples.

    A step's batches are laid out in padded blocks of runs (the runs' parameters used as stacked) when
    padding to the largest batch costs at most ``padding_limit`` times the drawn examples, else as a
    flat list of examples with their run's parameters gathered (few examples per run, e.g. q ≈ 0.002).

    Args:
        model: the architecture and the shared initial parameters (not modified).
        x_pool, y_pool: every example any run may use (training set, then extra targets).
        members: (M, P) bool; run m trains on the pool rows where ``members[m]`` is True.
        sample_rate, noise_multiplier, clip_norm, normaliser: q, σ, C and the divisor of the noisy
            sum (the training set's q·N).
        lr, momentum: SGD's step size and momentum.
        seed: seeds the batch draws and the noise.
        device: where the runs train.
    """

    def __init__(
        self,
        model: nn.Module,
        x_pool: torch.Tensor,
        y_pool: torch.Tensor,
        members,
        sample_rate: float,
        noise_multiplier: float,
        clip_norm: float,
        normaliser: float,
        lr: float,
        momentum: float,
        seed: int,
        device="cpu",
    ):
        layers = _layers(model)
        if layers is None:
            raise InvalidParameterError(
                "model",
                type(model).__name__,
                "must be an nn.Sequential of Conv2d (groups 1, "
                "zero padding), Linear, pooling, Flatten and element-wise activations",
            )
        members = torch.as_tensor(np.asarray(members, dtype=bool))
        if members.ndim != 2 or members.shape[1] != len(y_pool):
            raise InvalidParameterError("members", tuple(members.shape), f"must be (runs, {len(y_pool)})")
        self.device = torch.device(device)
        self.layers = layers
        self.runs = int(members.shape[0])
        self.params: list[dict] = []  # per parametric layer: {"weight": (M, ...), "bias": (M, ...)}
        for m in layers:
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                self.params.append(
                    {
                        k: v.detach().to(self.device).unsqueeze(0).repeat(self.runs, *([1] * v.ndim)).contiguous()
                        for k, v in (("weight", m.weight), ("bias", m.bias))
                        if v is not None
                    }
                )
        self.momentum_buf = [{k: torch.zeros_like(v) for k, v in p.items()} for p in self.params]
        self.dim = sum(int(v[0].numel()) for p in self.params for v in p.values())
        self.x_pool, self.y_pool = x_pool.to(self.device), y_pool.to(self.device)
        self.members = members
        self.q, self.sigma, self.clip = float(sample_rate), float(noise_multiplier), float(clip_norm)
        self.normaliser, self.lr, self.mu = float(normaliser), float(lr), float(momentum)
        self.sampling = seeded_generator("cpu", derive_seed(seed, 1))  # every bit of the seed counts
        self.noise = seeded_generator("cpu", derive_seed(seed, 2))
        self.last_batches: list[torch.Tensor] = []
        self.padding_limit = 1.5

    # --- the stacked network -------------------------------------------------------------
    def _forward(self, x: torch.Tensor, run, record: bool):
        """Logits (n, classes) of examples ``x`` (n, ...) and, with ``record``, each parametric layer's (layer,
        input columns, output).

        ``run``: a tensor (n,) — example i under run ``run[i]``'s parameters, gathered per example (few examples
        per run) — or a block ``(lo, hi)`` — ``x`` holds runs lo … hi−1's examples, the same number each, run
        after run, and the runs' stacked parameters are used as they are (batched matrix products; many
        examples per run).
        """
        n = x.shape[0]
        block = isinstance(run, tuple)
        if block:
            lo, hi = run
            r = hi - lo
            k = n // r
        h = x
        saved, i = [], 0
        for m in self.layers:
            if isinstance(m, nn.Conv2d):
                p = self.params[i]
                i += 1
                cols = F.unfold(h, m.kernel_size, m.dilation, m.padding, m.stride)  # (n, cin·kh·kw, L)
                size = [
                    (h.shape[2 + d] + 2 * m.padding[d] - m.dilation[d] * (m.kernel_size[d] - 1) - 1) // m.stride[d] + 1
                    for d in (0, 1)
                ]
                cout, length = p["weight"].shape[1], cols.shape[2]
                if block:
                    w = p["weight"][lo:hi].reshape(r, cout, -1)
                    cc = cols.reshape(r, k, -1, length).permute(0, 2, 1, 3).reshape(r, -1, k * length)
                    z = torch.bmm(w, cc).reshape(r, cout, k, length).permute(0, 2, 1, 3)  # (r, k, cout, L)
                    if "bias" in p:
                        z = z + p["bias"][lo:hi][:, None, :, None]
                else:
                    z = torch.bmm(p["weight"][run].reshape(n, cout, -1), cols)  # (n, cout, L)
                    if "bias" in p:
                        z = z + p["bias"][run][:, :, None]
                z = z.reshape(n, cout, *size)
            elif isinstance(m, nn.Linear):
                p = self.params[i]
                i += 1
                if h.ndim != 2:
                    raise InvalidParameterError("model", "Linear", "must take flat inputs (a Flatten before it)")
                cols = h
                if block:
                    z = torch.bmm(h.reshape(r, k, -1), p["weight"][lo:hi].transpose(1, 2))
                    if "bias" in p:
                        z = z + p["bias"][lo:hi][:, None, :]
                    z = z.reshape(n, -1)
                else:
                    z = torch.bmm(p["weight"][run], h.unsqueeze(2)).squeeze(2)
                    if "bias" in p:
                        z = z + p["bias"][run]
            else:
                h = m(h)
                continue
            if record:
                z.requires_grad_(True)
                saved.append((m, cols, z))
            h = z
        return h, saved

    def _per_example(self, x: torch.Tensor, y: torch.Tensor, run):
        """Squared per-example gradient norms (n,) of examples ``x`` under ``run`` (see :meth:`_forward`), and
        the per-layer pieces of the per-example gradients (for :meth:`_sums`)."""
        with torch.enable_grad():
            logits, saved = self._forward(x, run, record=True)
            loss = F.cross_entropy(logits, y, reduction="sum")
            backs = torch.autograd.grad(loss, [z for _, _, z in saved])
        n = x.shape[0]
        sq = torch.zeros(n, device=self.device, dtype=logits.dtype)
        pieces = []
        for (m, a, _), b in zip(saved, backs, strict=True):
            a = a.detach()
            if isinstance(m, nn.Linear):  # g_W = b·aᵀ: ‖g_W‖ = ‖b‖·‖a‖
                b = b.detach()
                sq = sq + b.pow(2).sum(1) * a.pow(2).sum(1)
                gb = b
                pieces.append(("outer", b, a, gb))
            else:  # g_W = B·colsᵀ per example
                b = b.detach().reshape(n, b.shape[1], -1)
                gw = torch.bmm(b, a.transpose(1, 2))  # (n, cout, cin·kh·kw)
                sq = sq + gw.pow(2).sum((1, 2))
                gb = b.sum(-1)
                pieces.append(("full", gw, None, gb))
            if m.bias is not None:
                sq = sq + gb.pow(2).sum(1)
        return sq, pieces

    def _sums(self, pieces, run, weights: torch.Tensor) -> list[dict]:
        """Σ_i weights[i]·g_i into each run's slot (``run`` as in :meth:`_forward`): per-parameter sums shaped
        like the stacked parameters."""
        n = weights.shape[0]
        wt = weights.reshape(n, 1)
        block = isinstance(run, tuple)
        if block:
            lo, hi = run
            r = hi - lo
            k = n // r
        sums = []
        for (kind, u, v, gb), p in zip(pieces, self.params, strict=True):
            out = {}
            for name, shape in ((k_, p[k_].shape) for k_ in p):
                if name == "bias":
                    val = gb * wt
                elif kind == "outer":
                    val = None
                else:
                    val = u * wt[:, :, None]
                if block:
                    if val is None:  # Σ_k f·b·aᵀ as one batched product, never per example
                        part = torch.bmm((u * wt).reshape(r, k, -1).transpose(1, 2), v.reshape(r, k, -1))
                    else:
                        part = val.reshape(r, k, -1).sum(1)
                    full = torch.zeros(shape, dtype=part.dtype, device=part.device)
                    full[lo:hi] = part.reshape(r, *shape[1:])
                else:
                    if val is None:
                        val = torch.einsum("no,ni->noi", u * wt, v)
                    full = torch.zeros(shape, dtype=val.dtype, device=val.device).index_add_(
                        0, run, val.reshape(n, *shape[1:])
                    )
                out[name] = full
            sums.append(out)
        return sums

    def _chunk(self) -> int:
        return max(1, MAX_BLOCK // max(1, self.dim))

    # --- one step ------------------------------------------------------------------------
    def _draw(self):
        """Poisson batches: each drawn (run, pool row) pair, sorted by run."""
        u = torch.rand(self.members.shape, generator=self.sampling)
        drawn = (u < self.q) & self.members
        runs, rows = torch.nonzero(drawn, as_tuple=True)  # row-major: sorted by run
        counts = drawn.sum(dim=1)
        self.last_batches = list(torch.split(rows, counts.tolist()))
        return runs.to(self.device), rows.to(self.device), counts

    def step(self) -> None:
        """One DP-SGD step of every run."""
        runs, rows, counts = self._draw()
        sums = [{n: torch.zeros_like(v) for n, v in p.items()} for p in self.params]
        k = int(counts.max()) if len(runs) else 0

        def add(part):
            for s, ps in zip(sums, part, strict=True):
                for n in s:
                    s[n] += ps[n]

        if k and self.runs * k <= self.padding_limit * len(runs):  # many examples per run: padded blocks of runs
            starts = torch.cumsum(counts, 0) - counts
            pos = torch.arange(len(runs)) - starts[runs.cpu()]
            idx = torch.zeros((self.runs, k), dtype=torch.long)
            idx[runs.cpu(), pos] = rows.cpu()
            valid = (torch.arange(k)[None, :] < counts[:, None]).to(self.device)
            idx = idx.to(self.device)
            chunk = max(1, MAX_BLOCK // max(1, k * self.dim))
            for lo in range(0, self.runs, chunk):
                hi = min(lo + chunk, self.runs)
                j = idx[lo:hi].reshape(-1)
                sq, pieces = self._per_example(self.x_pool[j], self.y_pool[j], (lo, hi))
                factor = (self.clip / (sq.sqrt() + 1e-6)).clamp(max=1.0) * valid[lo:hi].reshape(-1)
                add(self._sums(pieces, (lo, hi), factor))
        else:  # few examples per run: each example with its run's weights
            chunk = self._chunk()
            for lo in range(0, len(runs), chunk):
                r, j = runs[lo : lo + chunk], rows[lo : lo + chunk]
                sq, pieces = self._per_example(self.x_pool[j], self.y_pool[j], r)
                factor = (self.clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)
                add(self._sums(pieces, r, factor))
        noise = torch.randn((self.runs, self.dim), generator=self.noise).to(self.device)
        offset = 0
        with torch.no_grad():
            for p, s, bufs in zip(self.params, sums, self.momentum_buf, strict=True):
                for n, v in p.items():
                    size = int(v[0].numel())
                    z = noise[:, offset : offset + size].reshape(v.shape)
                    offset += size
                    g = (s[n] + self.sigma * self.clip * z) / self.normaliser
                    bufs[n].mul_(self.mu).add_(g)
                    v.sub_(self.lr * bufs[n])

    # --- measurements --------------------------------------------------------------------
    def grad_norms(self, runs, rows) -> np.ndarray:
        """‖∇ℓ(θ_m, x_j)‖ (unclipped) at the current parameters for the pairs (run ``runs[i]``, pool row
        ``rows[i]``)."""
        runs = torch.as_tensor(np.asarray(runs, dtype=np.int64).ravel(), device=self.device)
        rows = torch.as_tensor(np.asarray(rows, dtype=np.int64).ravel(), device=self.device)
        out = [
            self._per_example(
                self.x_pool[rows[lo : lo + self._chunk()]],
                self.y_pool[rows[lo : lo + self._chunk()]],
                runs[lo : lo + self._chunk()],
            )[0]
            .sqrt()
            .detach()
            .cpu()
            for lo in range(0, len(runs), self._chunk())
        ]
        return torch.cat(out).double().numpy() if out else np.zeros(0)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, batch_size: int = 512) -> np.ndarray:
        """(M, len(x)) predicted classes of every run."""
        out = np.zeros((self.runs, len(x)), dtype=np.int64)
        for m in range(self.runs):
            for lo in range(0, len(x), batch_size):
                h = x[lo : lo + batch_size].to(self.device)
                i = 0
                for layer in self.layers:
                    if isinstance(layer, (nn.Conv2d, nn.Linear)):
                        p = self.params[i]
                        i += 1
                        w, b = p["weight"][m], p["bias"][m] if "bias" in p else None
                        h = (
                            F.conv2d(h, w, b, layer.stride, layer.padding, layer.dilation)
                            if isinstance(layer, nn.Conv2d)
                            else F.linear(h, w, b)
                        )
                    else:
                        h = layer(h)
                out[m, lo : lo + len(h)] = h.argmax(-1).cpu().numpy()
        return out


def parallel_chains(
    dataset,
    x_pts: torch.Tensor,
    y_pts: torch.Tensor,
    points: np.ndarray,
    target_set: str,
    runs: int,
    model: nn.Module,
    q: float,
    sigma: float,
    clip: float,
    normaliser: float,
    steps: int,
    every: int,
    lr: float,
    momentum: float,
    seed: int,
    device="cpu",
    progress: bool = False,
) -> dict:
    """Train the per-instance analysis' runs together and record each target's clipped gradient norm.

    ``runs`` runs on the shared training set (X for test-set targets, X' for training-set targets)
    and ``runs`` on each target's own dataset (X' = X ∪ {x*} or X = X' \\ {x*}).  Before every
    ``every``-th step (θ_t, before step t + 1) each shared run records min(‖∇ℓ(θ, x*)‖, C) for every
    target and each own run for its target.

    Returns ``shared`` and ``own``, each {"sens": (runs, checkpoints, targets), "correct": (runs,
    targets) — the target classified correctly by the final model}, ``checkpoints`` (the steps t),
    ``test_accuracy_runs`` (the shared runs') and ``test_accuracy_own_runs``.
    """
    from tqdm import tqdm

    n_train, k = len(dataset.y_train), len(points)
    if target_set == "test":
        x_pool, y_pool = torch.cat([dataset.x_train, x_pts]), torch.cat([dataset.y_train, y_pts])
        rows = n_train + np.arange(k)
        shared = np.zeros((1, n_train + k), bool)
        shared[0, :n_train] = True
        own = np.repeat(shared, k, axis=0)
        own[np.arange(k), rows] = True
    else:
        x_pool, y_pool = dataset.x_train, dataset.y_train
        rows = np.asarray(points, dtype=np.int64)
        shared = np.ones((1, n_train), bool)
        own = np.repeat(shared, k, axis=0)
        own[np.arange(k), rows] = False
    members = np.concatenate([np.repeat(shared, runs, axis=0), np.repeat(own, runs, axis=0)])  # own: target-major
    pr = ParallelRuns(model, x_pool, y_pool, members, q, sigma, clip, normaliser, lr, momentum, seed, device)
    shared_ids = np.arange(runs)
    own_ids = runs + np.arange(k * runs)
    pair_runs = np.concatenate([np.repeat(shared_ids, k), own_ids])
    pair_rows = np.concatenate([np.tile(rows, runs), np.repeat(rows, runs)])
    ckpts, s_shared, s_own = [], [], []
    for t in tqdm(range(steps), disable=None if progress else True, desc="per-instance runs", unit="step", leave=False):
        if t % every == 0:
            norms = np.minimum(pr.grad_norms(pair_runs, pair_rows), clip)
            ckpts.append(t)
            s_shared.append(norms[: runs * k].reshape(runs, k))
            s_own.append(norms[runs * k :].reshape(k, runs).T)
        pr.step()
    pred = pr.predict(x_pts)  # (M, k)
    truth = y_pts.numpy()
    correct_shared = pred[:runs] == truth[None, :]
    correct_own = (pred[own_ids, np.repeat(np.arange(k), runs)] == np.repeat(truth, runs)).reshape(k, runs).T
    test_pred = pr.predict(dataset.x_test)
    acc = (test_pred == dataset.y_test.numpy()[None, :]).mean(axis=1)
    return {
        "shared": {"sens": np.stack(s_shared, axis=1), "correct": correct_shared},
        "own": {"sens": np.stack(s_own, axis=1), "correct": correct_own},
        "checkpoints": np.asarray(ckpts),
        "test_accuracy_runs": [float(a) for a in acc[:runs]],
        "test_accuracy_own_runs": [float(a) for a in acc[runs:]],
    }
