"""The provenance rule tables check themselves (issue 46, item 5): every operation with a rule in
``idpsgd.engine.per_example.bk.provenance`` — read off its tables and its registry of rules by name, so a
new rule is covered without touching this file — runs on random tensors of the batch, once as tagged
and once with one example's rows perturbed, and the output entries that change must be where its rule
says: a result claimed to have one example per row (``Rows(dim, group)``) changes only that example's rows,
a result left untagged (shape only, a constant) changes nowhere, and any other change (a reduction
over the batch, a shift of rows) must be claimed as mixing.  The claim "mixing" is always sound; the
test finds the rules that claim too little mixing (``new_tensor`` and ``diff`` before the fix).

Each operation is called through the candidate calls of its table (positional and keyword forms, the
batch dimension and others) plus its own where its signature needs them (:data:`CALLS`); a candidate
the operation rejects is skipped, and an operation no candidate can run fails the test (it needs a
generator here).  Three layouts of the batch: batch first (B, T, d), time first (T, B, d), and rows
grouped by example (B·2, T, d) with ``Rows(0, 2)``."""

from __future__ import annotations

import typing
import warnings

import torch

from idpsgd.engine.per_example.bk import provenance as P

B, T, D = 4, 3, 6
EXAMPLE = 1  # the example whose rows are perturbed

LAYOUTS = {  # name -> (shape, rows of the batch inputs)
    "batch-first": ((B, T, D), P.Rows(0, 1)),
    "time-first": ((T, B, D), P.Rows(1, 1)),
    "grouped": ((2 * B, T, D), P.Rows(0, 2)),
}


class Env:
    """The inputs of one call, fresh copies of :class:`_Inputs` (an in-place operation writes its own)."""

    _made: typing.ClassVar[dict] = {}

    def __new__(cls, layout: str, perturbed: bool):
        proto = cls._made.get((layout, perturbed))
        if proto is None:
            proto = cls._made[(layout, perturbed)] = _Inputs(layout, perturbed)
        e = object.__new__(cls)
        e.__dict__.update({k: v.clone() if torch.is_tensor(v) else v for k, v in proto.__dict__.items()})
        e.batch = [getattr(e, k) for k in proto.batch_names]
        return e


class _Inputs:
    """The inputs of one call: tensors of the batch (tagged; ``a``, ``a2``, ``a3`` floats, ``ai``, ``ai2`` ints
    in [0, 3), ``ab``, ``ab2`` booleans, ``ids`` token ids) and constants shared by the batch (equal along the
    batch dimension), with example ``EXAMPLE``'s rows perturbed when ``perturbed``."""

    def __init__(self, layout: str, perturbed: bool):
        shape, rows = LAYOUTS[layout]
        self.rows, self.shape = rows, shape
        self.batch_names = []
        g = torch.Generator().manual_seed(0)
        h = torch.Generator().manual_seed(1)
        self.batch = []

        def batch(make, change):
            self.batch_names.append(_NAMES[len(self.batch)])
            t = make(g)
            if perturbed:
                idx = [slice(None)] * t.dim()
                idx[rows.dim] = slice(EXAMPLE * rows.group, (EXAMPLE + 1) * rows.group)
                t[tuple(idx)] = change(t[tuple(idx)], h)
            self.batch.append(t)
            return t

        fl = lambda g: torch.randn(shape, generator=g, dtype=torch.float64)  # noqa: E731
        self.a = batch(fl, lambda v, h: v + torch.randn(v.shape, generator=h, dtype=v.dtype))
        self.a2 = batch(fl, lambda v, h: v - 2 * torch.randn(v.shape, generator=h, dtype=v.dtype))
        self.a3 = batch(lambda g: fl(g).abs() + 0.5, lambda v, h: v + 1.0)
        ints = lambda g: torch.randint(0, 3, shape, generator=g)  # noqa: E731
        self.ai = batch(ints, lambda v, h: (v + 1) % 3)
        self.ai2 = batch(ints, lambda v, h: (v + 2) % 3)
        self.ab = batch(lambda g: torch.rand(shape, generator=g) > 0.5, lambda v, h: ~v)
        self.ab2 = batch(lambda g: torch.rand(shape, generator=g) > 0.5, lambda v, h: ~v)
        self.ids = batch(lambda g: torch.randint(0, 7, shape, generator=g), lambda v, h: (v + 3) % 7)
        one = list(shape)
        one[rows.dim] = 1
        c = torch.Generator().manual_seed(2)
        # constants: the same in every row of the batch dimension (no place in the batch to depend on)
        self.c_same = torch.randn(one, generator=c, dtype=torch.float64).expand(shape).contiguous()
        self.cb = self.c_same > 0
        self.c_row = torch.randn(shape[-1], generator=c, dtype=torch.float64)
        self.W = torch.randn(5, shape[-1], generator=c, dtype=torch.float64)
        self.bias = torch.randn(5, generator=c, dtype=torch.float64)
        self.E = torch.randn(7, 4, generator=c, dtype=torch.float64)
        self.idx = torch.tensor([0, 2])
        self.gidx = torch.randint(0, 3, one, generator=c).expand(shape).contiguous()
        self.n0, self.n1, self.n2 = shape


_NAMES = ("a", "a2", "a3", "ai", "ai2", "ab", "ab2", "ids")


def _dims(*calls):
    """The calls for each dimension d in (0, 1, 2, -1) (the batch dimension among them in every layout)."""
    return [(lambda f, e, c=c, d=d: c(f, e, d)) for c in calls for d in (0, 1, 2, -1)]


def _set(index, value):
    def call(f, e):
        t = e.a.clone()
        f(t, index(e) if callable(index) else index, value(e) if callable(value) else value)
        return t

    return call


def _set_into_zeros(index, value):
    def call(f, e):
        t = torch.zeros(e.shape, dtype=torch.float64)
        f(t, index, value(e))
        return t

    return call


POINTWISE = [
    lambda f, e: f(e.a),
    lambda f, e: f(e.a3),
    lambda f, e: f(e.a, e.a2),
    lambda f, e: f(e.a, e.c_row),
    lambda f, e: f(e.c_row, e.a),
    lambda f, e: f(e.c_same, e.a),
    lambda f, e: f(e.a, 0.5),
    lambda f, e: f(e.ai),
    lambda f, e: f(e.ai, e.ai2),
    lambda f, e: f(e.ab),
    lambda f, e: f(e.ab, e.ab2),
    lambda f, e: f(e.a, e.a2, e.a3),
]
ALONG_DIM = _dims(
    lambda f, e, d: f(e.a, d),
    lambda f, e, d: f(e.a, dim=d),
)
REDUCTIONS = [
    lambda f, e: f(e.a),
    lambda f, e: f(e.ab),
    lambda f, e: f(e.a, (1, 2)),
    lambda f, e: f(e.a, dim=(0, 1)),
    *_dims(
        lambda f, e, d: f(e.a, d),
        lambda f, e, d: f(e.a, dim=d),
        lambda f, e, d: f(e.a, d, True),
        lambda f, e, d: f(e.a, d, keepdim=True),
        lambda f, e, d: f(e.a, d, True, True),
        lambda f, e, d: f(e.ab, d),
    ),
]
RESHAPES = [
    lambda f, e: f(e.a, (-1, e.n2)),
    lambda f, e: f(e.a, (e.n0, -1)),
    lambda f, e: f(e.a, (-1,)),
    lambda f, e: f(e.a, (e.n0, e.n1, 2, 3)),
    lambda f, e: f(e.a, (1, e.n0, e.n1, e.n2)),
    lambda f, e: f(e.a, (2, e.n0 // 2, e.n1, e.n2)),
    lambda f, e: f(e.a, e.n0 * e.n1, e.n2),
    lambda f, e: f(e.a),
    lambda f, e: f(e.a, 1),
    lambda f, e: f(e.a, 0, 1),
    lambda f, e: f(e.a, -1, (2, 3)),
    lambda f, e: f(e.a, 0, (2, e.n0 // 2)),
    lambda f, e: f(e.a, e.c_same.reshape(-1, e.n2)),
    lambda f, e: f(e.a.unsqueeze(1), 1),
    lambda f, e: f(e.a, -1),
    lambda f, e: f(e.c_same, (-1,)),
]
EXPANDS = [
    lambda f, e: f(e.a.unsqueeze(1), (e.n0, 2, e.n1, e.n2)),
    lambda f, e: f(e.a.unsqueeze(1), -1, 2, -1, -1),
    lambda f, e: f(e.a, 2, e.n0, e.n1, e.n2),
    lambda f, e: f(e.a.unsqueeze(1), torch.zeros(e.n0, 2, e.n1, e.n2)),
    lambda f, e: f(e.a[:1], e.shape),
    lambda f, e: f(e.c_row, e.shape),
]
PERMUTES = [
    lambda f, e: f(e.a, 0, 1),
    lambda f, e: f(e.a, 1, 2),
    lambda f, e: f(e.a, dim0=0, dim1=2),
    lambda f, e: f(e.a, (2, 0, 1)),
    lambda f, e: f(e.a, 2, 0, 1),
    lambda f, e: f(e.a, dims=(1, 0, 2)),
    lambda f, e: f(e.a, (0, 1), (2, 0)),
    lambda f, e: f(e.a, source=2, destination=0),
    lambda f, e: f(e.a.reshape(e.n0, -1)),
    lambda f, e: f(e.a),
]
SPLITS = [
    lambda f, e: f(e.a),
    lambda f, e: f(e.a, 2),
    *_dims(
        lambda f, e, d: f(e.a, 2, d),
        lambda f, e, d: f(e.a, 2, dim=d),
        lambda f, e, d: f(e.a, [1, e.shape[d] - 1], d),
        lambda f, e, d: f(e.a, d),
        lambda f, e, d: f(e.a, d, 0),
        lambda f, e, d: f(e.a, d, 1, 2),
        lambda f, e, d: f(e.a, d, e.idx),
        lambda f, e, d: f(e.a, d, e.ai.reshape(-1)[:2]),
    ),
]
JOINS = [
    *_dims(
        lambda f, e, d: f([e.a, e.a2], d),
        lambda f, e, d: f([e.a, e.c_same], d),
        lambda f, e, d: f(tensors=(e.a, e.a2), dim=d),
    ),
    lambda f, e: f([e.a, e.a2]),
    lambda f, e: f([e.a, e.a2], 3),
]
MATMULS = [
    lambda f, e: f(e.a, e.c_row),  # (..., d) @ (d,)
    lambda f, e: f(e.c_row[: e.n1], e.a),  # (d,) @ (..., d, p)
    lambda f, e: f(e.a, e.W.T),
    lambda f, e: f(e.a, e.a2.transpose(-1, -2)),
    lambda f, e: f(e.a.transpose(-1, -2), e.a2),
    lambda f, e: f(torch.ones(e.n1, e.n1, dtype=torch.float64), e.a),
    lambda f, e: f(e.a.reshape(e.n0, -1).T, e.a.reshape(e.n0, -1)),
    lambda f, e: f(e.a.reshape(-1, e.n2), e.W.T),
    lambda f, e: f(e.a, e.W.T[None].expand(e.n0, -1, -1)),
    lambda f, e: f(e.W, e.a.reshape(-1, e.n2).T),
]
GETITEM = [
    lambda f, e: f(e.a, (slice(None), 0)),
    lambda f, e: f(e.a, 0),
    lambda f, e: f(e.a, slice(1, None)),
    lambda f, e: f(e.a, (slice(None), slice(1, None))),
    lambda f, e: f(e.a, (slice(None), [0, 2])),
    lambda f, e: f(e.a, (Ellipsis, 0)),
    lambda f, e: f(e.a, None),
    lambda f, e: f(e.a, e.ab),
    lambda f, e: f(e.a, torch.arange(e.n0)),
    lambda f, e: f(e.a, torch.arange(e.n0).flip(0)),
    lambda f, e: f(e.a, (torch.arange(e.n0), e.ai[:, 0, 0])),
    lambda f, e: f(e.a, (torch.arange(e.n0)[:, None], e.ai[:, :, 0])),
    lambda f, e: f(e.a, (slice(None), e.ai[:, 0, 0])),
]
SETITEM = [
    _set((slice(None), 0), 0.0),
    _set(0, 1.0),
    _set((slice(None), 1), lambda e: e.a2[:, 2]),
    _set((slice(None), 1), lambda e: e.c_same[:, 2]),
    _set(lambda e: e.ab, 0.0),
    _set(slice(None), lambda e: e.c_same),
    _set(slice(1, None), lambda e: e.a2[:-1]),
    _set_into_zeros((slice(None), slice(1, None)), lambda e: e.a[:, :-1]),
    _set_into_zeros((slice(None), 0), lambda e: e.a[:, 0]),
    _set_into_zeros(slice(1, None), lambda e: e.a[:-1]),
]
LIKE = [
    lambda f, e: f(e.a),
    lambda f, e: f(e.a, 2.0),
    lambda f, e: f(e.a, (2, 3)),
    lambda f, e: f(e.a, (2, 3), 1.5),
    lambda f, e: f(e.a, e.shape, e.a.sum()),
    lambda f, e: f(e.a, e.a2),
    lambda f, e: f(e.a, e.a2[:, 0]),
    lambda f, e: f(e.a, [1.0, 2.0]),
    lambda f, e: f(e.c_same, e.a),
]
PROPS = [
    lambda f, e: f(e.a.reshape(e.n0, -1)),
    lambda f, e: f(e.a),
]


def _a4(e):
    return e.a.unsqueeze(1)  # (n0, 1, n1, n2)


#: an operation's own calls, by name (added to its table's)
CALLS = {
    "masked_fill": [
        lambda f, e: f(e.a, e.ab, 0.0),
        lambda f, e: f(e.a, e.cb, 1.0),
        lambda f, e: f(e.a, e.ab, e.a.sum()),
    ],
    "lerp": [lambda f, e: f(e.a, e.a2, 0.3), lambda f, e: f(e.a, e.c_same, e.a2)],
    "addcmul": [lambda f, e: f(e.a, e.a2, e.c_same, value=0.5)],
    "clamp": [lambda f, e: f(e.a, -0.5, 0.5), lambda f, e: f(e.a, min=0.1), lambda f, e: f(e.a, min=e.a2)],
    "threshold": [lambda f, e: f(e.a, 0.1, 0.0)],
    "to": [
        lambda f, e: f(e.a, torch.float32),
        lambda f, e: f(e.a, dtype=torch.float32),
        lambda f, e: f(e.a, "cpu"),
        lambda f, e: f(e.a, e.c_same.float()),  # to(other): the other's dtype and device only
        lambda f, e: f(e.c_same, e.ai),
    ],
    "type": [lambda f, e: f(e.a, torch.float32)],
    "copy_": [lambda f, e: f(e.c_same.clone(), e.a), lambda f, e: f(e.a, e.c_row)],
    "fill_": [lambda f, e: f(e.a, 1.0), lambda f, e: f(e.a, e.a.sum())],
    "topk": [*_dims(lambda f, e, d: f(e.a, 2, d), lambda f, e, d: f(e.a, 2, dim=d)), lambda f, e: f(e.a, 2)],
    "kthvalue": [
        *_dims(
            lambda f, e, d: f(e.a, 2, d),
            lambda f, e, d: f(e.a, 2, d, True),
            lambda f, e, d: f(e.a, 2, dim=d, keepdim=True),
        ),
        lambda f, e: f(e.a, 2),
    ],
    "flip": [*_dims(lambda f, e, d: f(e.a, [d]), lambda f, e, d: f(e.a, dims=(d,))), lambda f, e: f(e.a, (0, 1))],
    "roll": [*_dims(lambda f, e, d: f(e.a, 1, d), lambda f, e, d: f(e.a, shifts=1, dims=d)), lambda f, e: f(e.a, 1)],
    "normalize": [*_dims(lambda f, e, d: f(e.a, 2.0, d)), lambda f, e: f(e.a)],
    "diff": [
        *_dims(
            lambda f, e, d: f(e.a, 1, d),
            lambda f, e, d: f(e.a, 2, d),
            lambda f, e, d: f(e.a, n=1, dim=d),
            lambda f, e, d: f(e.a, 1, d, e.a2),
            lambda f, e, d: f(e.a, 1, d, None, e.c_same),
            lambda f, e, d: f(e.a, dim=d, append=e.a2),
            lambda f, e, d: f(e.c_same, 1, d, e.a),
        ),
        lambda f, e: f(e.a),
    ],
    "sort": _dims(lambda f, e, d: f(e.a, d, True)),
    "norm": _dims(
        lambda f, e, d: f(e.a, 2, d),
        lambda f, e, d: f(e.a, 2, d, True),
        lambda f, e, d: f(e.a, p=1, dim=d, keepdim=True),
    ),
    "std": _dims(lambda f, e, d: f(e.a, d, correction=0), lambda f, e, d: f(e.a, d, True, False)),
    "aminmax": _dims(lambda f, e, d: f(e.a, dim=d), lambda f, e, d: f(e.a, dim=d, keepdim=True)),
    "max": [lambda f, e: f(e.a, e.a2)],
    "linear": [
        lambda f, e: f(e.a, e.W),
        lambda f, e: f(e.a, e.W, e.bias),
        lambda f, e: f(e.a.transpose(-1, -2), e.W[:, : e.n1]),
    ],
    "addmm": [
        lambda f, e: f(e.bias, e.a.reshape(-1, e.n2), e.W.T),
        lambda f, e: f(e.bias, e.a.reshape(e.n0, -1)[:, : e.n2], e.W.T),
        lambda f, e: f(torch.zeros(e.n1, 5, dtype=torch.float64), e.a.reshape(e.n0, -1).T[: e.n1], e.W.T[: e.n0]),
    ],
    "baddbmm": [
        lambda f, e: f(torch.zeros(1, e.n1, 5, dtype=torch.float64), e.a, e.W.T[None].expand(e.n0, -1, -1)),
        lambda f, e: f(
            e.a[..., :2], e.a, e.a2[:, :, :2].transpose(-1, -2)[..., :2].transpose(-1, -2).expand(-1, -1, -1)
        ),
        lambda f, e: f(e.a @ e.W.T, e.a, e.W.T[None].expand(e.n0, -1, -1)),
    ],
    "one_hot": [lambda f, e: f(e.ids), lambda f, e: f(e.ids, 7)],
    "conv1d": [lambda f, e: f(e.a, torch.ones(2, e.n1, 3, dtype=torch.float64))],
    "conv2d": [lambda f, e: f(_a4(e), torch.ones(2, 1, 2, 2, dtype=torch.float64))],
    "conv3d": [lambda f, e: f(_a4(e).unsqueeze(1), torch.ones(2, 1, 1, 2, 2, dtype=torch.float64))],
    "conv_transpose1d": [lambda f, e: f(e.a, torch.ones(e.n1, 2, 3, dtype=torch.float64))],
    "conv_transpose2d": [lambda f, e: f(_a4(e), torch.ones(1, 2, 2, 2, dtype=torch.float64))],
    "conv_transpose3d": [lambda f, e: f(_a4(e).unsqueeze(1), torch.ones(1, 2, 1, 2, 2, dtype=torch.float64))],
    "max_pool1d": [lambda f, e: f(e.a, 2)],
    "max_pool2d": [lambda f, e: f(_a4(e), 2)],
    "max_pool3d": [lambda f, e: f(_a4(e).unsqueeze(1), (1, 2, 2))],
    "avg_pool1d": [lambda f, e: f(e.a, 2)],
    "avg_pool2d": [lambda f, e: f(_a4(e), 2)],
    "avg_pool3d": [lambda f, e: f(_a4(e).unsqueeze(1), (1, 2, 2))],
    "adaptive_avg_pool1d": [lambda f, e: f(e.a, 2)],
    "adaptive_avg_pool2d": [lambda f, e: f(_a4(e), 2)],
    "adaptive_max_pool1d": [lambda f, e: f(e.a, 2)],
    "adaptive_max_pool2d": [lambda f, e: f(_a4(e), 2)],
    "interpolate": [lambda f, e: f(e.a, scale_factor=2.0), lambda f, e: f(e.a, size=4)],
    "upsample": [lambda f, e: f(e.a, scale_factor=2.0)],
    "pixel_shuffle": [lambda f, e: f(e.a.reshape(e.n0, -1, 1, 1)[:, :4], 2), lambda f, e: f(e.a[:, :2, :2], 2)],
    "pixel_unshuffle": [lambda f, e: f(_a4(e), 3), lambda f, e: f(e.a, 3)],
    "unfold": [lambda f, e: f(_a4(e), 2), *_dims(lambda f, e, d: f(e.a, d, 2, 1))],
    "fold": [lambda f, e: f(e.a.reshape(e.n0, -1)[:, :8].reshape(e.n0, 4, 2), (2, 3), 2)],
    "layer_norm": [
        lambda f, e: f(e.a, (e.n2,)),
        lambda f, e: f(e.a, (e.n1, e.n2)),
        lambda f, e: f(e.a, [e.n2], torch.ones(e.n2, dtype=torch.float64), torch.zeros(e.n2, dtype=torch.float64)),
    ],
    "rms_norm": [lambda f, e: f(e.a, (e.n2,)), lambda f, e: f(e.a, (e.n1, e.n2))],
    "group_norm": [lambda f, e: f(e.a, 1), lambda f, e: f(e.a, e.n1)],
    "scaled_dot_product_attention": [
        lambda f, e: f(e.a[:, None], e.a2[:, None], e.a2[:, None]),
        lambda f, e: f(e.a, e.c_same, e.c_same),
        lambda f, e: f(e.a, e.a2, e.a2, attn_mask=e.cb[..., : e.n1]),
        lambda f, e: f(e.a.transpose(0, 1), e.a2.transpose(0, 1), e.a2.transpose(0, 1)),
    ],
    "pad": [
        lambda f, e: f(e.a, (1, 1)),
        lambda f, e: f(e.a, (0, 0, 1, 0)),
        lambda f, e: f(e.a, (0, 0, 0, 0, 1, 1)),
        lambda f, e: f(e.a, (1, 1), value=2.0),
    ],
    "tril": [lambda f, e: f(e.a), lambda f, e: f(e.a, 1)],
    "diagonal": [
        lambda f, e: f(e.a),
        lambda f, e: f(e.a, 0, 1, 2),
        lambda f, e: f(e.a, 0, 0, 2),
        lambda f, e: f(e.a, dim1=-2, dim2=-1),
        lambda f, e: f(e.a, offset=1, dim1=0, dim2=1),
    ],
    "gather": [
        *_dims(lambda f, e, d: f(e.a, d, e.gidx), lambda f, e, d: f(e.a, d, e.ai)),
        lambda f, e: f(e.a, 2, e.gidx[:, :, :2]),
        lambda f, e: f(e.a, 2, e.gidx[:1] if e.rows.dim == 0 else e.gidx[:, :1]),
    ],
    "take_along_dim": [
        *_dims(lambda f, e, d: f(e.a, e.gidx, d), lambda f, e, d: f(e.a, e.ai, dim=d)),
        lambda f, e: f(e.a, e.gidx),
    ],
    "scatter": _dims(lambda f, e, d: f(e.a, d, e.gidx, e.a2), lambda f, e, d: f(e.a, d, e.ai, 0.0)),
    "scatter_add": _dims(lambda f, e, d: f(e.a, d, e.gidx, e.a2)),
    "index_add": _dims(lambda f, e, d: f(e.a, d, e.idx, e.a2.narrow(d, 0, 2))),
    "index_fill": _dims(lambda f, e, d: f(e.a, d, e.idx, 0.0)),
    "masked_scatter": [lambda f, e: f(e.a, e.ab, e.a2), lambda f, e: f(e.a, e.cb, e.a2)],
    "repeat_interleave": [
        *_dims(lambda f, e, d: f(e.a, 2, d), lambda f, e, d: f(e.a, 2, dim=d)),
        lambda f, e: f(e.a, 2),
    ],
    "repeat": [
        lambda f, e: f(e.a, 1, 2, 1),
        lambda f, e: f(e.a, 2, 1, 1),
        lambda f, e: f(e.a, (1, 1, 2)),
        lambda f, e: f(e.a, 1, 1, 1, 2),
        lambda f, e: f(e.a, 2, 1, 1, 1),
    ],
    "cross_entropy": [
        lambda f, e: f(e.a.reshape(e.n0, -1), e.ai.reshape(e.n0, -1)[:, 0], reduction="none"),
        lambda f, e: f(e.a.reshape(e.n0, -1), e.ai.reshape(e.n0, -1)[:, 0]),
        lambda f, e: f(e.a, e.ai[:, 0], reduction="none"),
    ],
    "mse_loss": [lambda f, e: f(e.a, e.a2, reduction="none"), lambda f, e: f(e.a, e.a2)],
    "binary_cross_entropy": [lambda f, e: f(e.a.sigmoid(), e.a2.sigmoid(), reduction="none")],
    # torch's own forms (arguments in another order than torch.nn.functional's)
    "kl_div": [lambda f, e: f(e.a, e.a2, 0)],
    "_threshold": [lambda f, e: f(e.a, 0.1, 0.0)],
    "dropout": [lambda f, e: f(e.a, 0.5, True)],
    "batch_norm": [
        lambda f, e: f(e.a, None, None, None, None, True, 0.1, 1e-5, False),
        lambda f, e: f(e.a, None, None, torch.zeros(e.n1, dtype=torch.float64), torch.ones(e.n1, dtype=torch.float64)),
        lambda f, e: f(
            e.a,
            None,
            None,
            torch.zeros(e.n1, dtype=torch.float64),
            torch.ones(e.n1, dtype=torch.float64),
            False,
            0.1,
            1e-5,
            False,
        ),
    ],
    "instance_norm": [lambda f, e: f(e.a, None, None, None, None, True, 0.1, 1e-5, False)],
    "binary_cross_entropy_with_logits": [lambda f, e: f(e.a, e.a2.sigmoid(), None, None, 0)],
    "embedding": [lambda f, e: f(e.E, e.ids)],
}
CALLS["where"] = [
    lambda f, e: f(e.ab, e.a, e.a2),
    lambda f, e: f(e.a > 0, e.a, 0.0),
    lambda f, e: f(e.cb, e.a, e.c_same),
    lambda f, e: f(e.a, e.ab, e.a2),  # Tensor.where(condition, other)
]
CALLS["batch_norm"] += [
    lambda f, e: f(e.a, torch.zeros(e.n1, dtype=torch.float64), torch.ones(e.n1, dtype=torch.float64)),
    lambda f, e: f(e.a, None, None, training=True),
    lambda f, e: f(
        e.a, torch.zeros(e.n1, dtype=torch.float64), torch.ones(e.n1, dtype=torch.float64), None, None, True
    ),
]
CALLS["instance_norm"] += [lambda f, e: f(e.a)]
CALLS["einsum"] = [
    lambda f, e: f("btd,kd->btk", e.a, e.W),
    lambda f, e: f("btd,kd->btk", [e.a, e.W]),
    lambda f, e: f("...d,kd->...k", e.a, e.W),
    lambda f, e: f("btd,btd->bt", e.a, e.a2),
    lambda f, e: f("btd,btd->td", e.a, e.a2),
    lambda f, e: f("btd,btd->bd", e.a, e.c_same),
    lambda f, e: f("btd,btd->bt", e.a, e.c_same + torch.arange(e.n0, dtype=torch.float64)[:, None, None]),
    lambda f, e: f("btd,bsd->bts", e.a, e.a2),
    lambda f, e: f("btd->d", e.a),
    lambda f, e: f("btd,btd", e.a, e.a2),
    lambda f, e: f("btd,d->bt", e.a, e.c_row),
    lambda f, e: f("bt...,bt...->b", e.a, e.a2),
]
# a constant table looked up at indices of the batch (position tables gathered per example)
CALLS["__getitem__"] = [
    lambda f, e: f(e.E, e.ids),
    lambda f, e: f(e.E, (e.ids,)),
    lambda f, e: f(e.E, (e.ids, 0)),
    lambda f, e: f(e.E, (slice(None), e.ai)),
    lambda f, e: f(e.E[None], (0, e.ids)),
    lambda f, e: f(e.E.reshape(7, 2, 2), (e.ids, slice(None), 0)),
    lambda f, e: f(e.E, (e.ids, e.ai)),
    lambda f, e: f(e.E, e.ab.long()),
]
CALLS["index_select"] = [
    lambda f, e: f(e.E, 0, e.ids.reshape(-1)),
    lambda f, e: f(e.E.t(), 1, e.ids.reshape(-1)),
    lambda f, e: f(e.E, 0, e.ids[:, 0, 0] if e.rows.dim == 0 else e.ids[0, :, 0]),
]
CALLS["binary_cross_entropy_with_logits"] += [lambda f, e: f(e.a, e.a2.sigmoid(), reduction="none")]
CALLS["kl_div"] += [lambda f, e: f(e.a, e.a2, reduction="none")]
CALLS["embedding"] += [lambda f, e: f(e.ids, e.E), lambda f, e: f(e.ids[:, 0], e.E)]
for _alias, _of in {
    "masked_fill_": "masked_fill",
    "addcdiv": "addcmul",
    "clip": "clamp",
    "alpha_dropout": "dropout",
    "feature_alpha_dropout": "dropout",
    "dropout_": "dropout",
    "clamp_": "clamp",
    "type_as": "to",
    "cummax": "sort",
    "argsort": "sort",
    "var": "std",
    "std_mean": "std",
    "var_mean": "std",
    "min": "max",
    "triu": "tril",
    "tril_": "tril",
    "triu_": "tril",
    "nll_loss": "cross_entropy",
    "l1_loss": "mse_loss",
    "smooth_l1_loss": "mse_loss",
    "huber_loss": "mse_loss",
}.items():
    CALLS[_alias] = CALLS[_of]
CALLS["type_as"] = [lambda f, e: f(e.a, e.ai), lambda f, e: f(e.a, e.c_same.float()), lambda f, e: f(e.c_same, e.ai)]

CALLS["scatter_"] = _dims(  # into a constant (Glm4-MoE's router: zeros_like(scores).scatter_(1, idx, 1))
    lambda f, e, d: f(e.c_same.clone(), d, e.gidx, e.a2),
    lambda f, e, d: f(e.c_same.clone(), d, e.gidx, 1.0),
    lambda f, e, d: f(e.c_row.clone(), d, e.gidx, 1.0),
)
CALLS["scatter_add_"] = _dims(lambda f, e, d: f(e.c_same.clone(), d, e.gidx, e.a2))
CALLS["scatter_"] += _dims(lambda f, e, d: f(e.a.clone(), d, e.gidx, e.a2))  # into the batch's tensor
CALLS["scatter_add_"] += _dims(lambda f, e, d: f(e.a.clone(), d, e.gidx, e.a2))
CALLS["broadcast_tensors"] = [  # the batch with constants (one per row, the same for every row) and itself
    lambda f, e: f(e.a, e.c_row),
    lambda f, e: f(e.c_same, e.a),
    lambda f, e: f(e.a, e.a2),
    lambda f, e: f(e.a, e.a.sum(0, keepdim=True)),
]
CALLS["index_copy"] = _dims(  # into the batch's tensor, or into a constant (a preallocated cache)
    lambda f, e, d: f(e.a, d, e.idx, e.a2.narrow(d, 0, 2)),
    lambda f, e, d: f(e.c_same, d, e.idx, e.a2.narrow(d, 0, 2)),
)
CALLS["index_copy_"] = CALLS["index_add_"] = _dims(
    lambda f, e, d: f(e.c_same.clone(), d, e.idx, e.a2.narrow(d, 0, 2)),
    lambda f, e, d: f(e.a.clone(), d, e.idx, e.a2.narrow(d, 0, 2)),
)
for _n in ("real", "imag", "conj", "conj_physical", "resolve_conj", "resolve_neg", "angle"):  # complex values
    CALLS[_n] = [lambda f, e: f(e.a * (1 + 2j)), lambda f, e: f(e.a)]
FFT = [  # torch.fft's transforms and shifts: the default dimensions, each dimension, and pairs of them
    lambda f, e: f(e.a),
    *_dims(lambda f, e, d: f(e.a, dim=d), lambda f, e, d: f(e.a, dim=(d,)), lambda f, e, d: f(e.a, axis=d)),
    *_dims(lambda f, e, d: f(e.a, None, (d, (d + 1) % 3)), lambda f, e, d: f(e.a, dim=(d, (d + 1) % 3))),
    lambda f, e: f(e.a, s=(2, 2)),
]

#: operations that cannot run here (no CUDA device), or whose values are uninitialised memory
UNRUNNABLE = {"cuda"} if not torch.cuda.is_available() else set()
UNINITIALISED = {"new_empty", "empty_like"}


def _functional_names() -> set[str]:
    """The names the provenance mode rules by name: its registry's keys (the operations in no family), less
    torch.fft's, which have their own table (:data:`FFT`)."""
    return set(P._NAMED_RULES) - set(P.FFT)


#: the operations ruled by name when this file was written: a handler taken out of the registry leaves its
#: operations claiming mixing, which is sound and so invisible to the perturbation check below; here it fails
RULED_BY_NAME = frozenset(
    """
    adaptive_avg_pool1d adaptive_avg_pool2d adaptive_max_pool1d adaptive_max_pool2d addmm angle avg_pool1d
    avg_pool2d avg_pool3d baddbmm batch_norm binary_cross_entropy broadcast_tensors binary_cross_entropy_with_logits
    conj conj_physical conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d cross_entropy
    diagonal einsum embedding fold gather group_norm huber_loss imag index_add index_add_ index_copy index_copy_
    index_fill instance_norm interpolate kl_div l1_loss layer_norm linear masked_scatter max_pool1d max_pool2d
    max_pool3d mse_loss nll_loss one_hot pad pixel_shuffle pixel_unshuffle real repeat repeat_interleave
    resolve_conj resolve_neg rms_norm scaled_dot_product_attention scatter scatter_ scatter_add scatter_add_
    smooth_l1_loss take_along_dim tril tril_ triu triu_ unfold upsample
    """.split()  # noqa: SIM905
)

TABLES = {
    "POINTWISE": (P.POINTWISE, POINTWISE),
    "ALONG_DIM": (P.ALONG_DIM, ALONG_DIM),
    "REDUCTIONS": (P.REDUCTIONS, REDUCTIONS),
    "RESHAPES": (P.RESHAPES, RESHAPES),
    "EXPANDS": (P.EXPANDS, EXPANDS),
    "PERMUTES": (P.PERMUTES, PERMUTES),
    "SPLITS": (P.SPLITS, SPLITS),
    "JOINS": (P.JOINS, JOINS),
    "MATMULS": (P.MATMULS, MATMULS),
    "GETITEM": (P.GETITEM, GETITEM),
    "SETITEM": (P.SETITEM, SETITEM),
    "LIKE": (P.LIKE | getattr(P, "NEW_TENSOR", set()), LIKE),
    "PROPS": (P.PROPS, PROPS),
    "FUNCTIONAL": (P._fns(*_functional_names()) | set(P.ROUTABLE), []),
    "FFT": ({getattr(torch.fft, name.removeprefix("fft_")) for name in P.FFT}, FFT),
}


def _ops():
    seen = {}
    for table, (funcs, calls) in TABLES.items():
        for f in funcs:
            name = P.op_name(f)
            key = (table, getattr(f, "__qualname__", name), getattr(f, "__module__", ""), name, id(f))
            seen[key] = (table, f, calls + CALLS.get(name, []))
    return sorted(seen.values(), key=lambda v: (v[0], P.op_name(v[1]), repr(v[1])))


def _tensors(out) -> list:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_floating_point():
        return ~torch.isclose(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)
    return a != b


NOT_RUN = "not run"


def _violation(f, call, layout) -> str | None:
    """None when the call's claims hold (or the call does not run); else what is wrong."""
    e = Env(layout, perturbed=False)
    mode = P.ProvenanceMode(e.a.shape[e.rows.dim] // e.rows.group)
    for t in e.batch:
        mode.tags[t] = e.rows
    try:
        torch.random.default_generator.manual_seed(0)  # CPU only (torch.manual_seed formats stacks for CUDA)
        with mode:
            out = call(f, e)
        torch.random.default_generator.manual_seed(0)  # CPU only (torch.manual_seed formats stacks for CUDA)
        out2 = call(f, Env(layout, perturbed=True))
    except Exception:  # the operation rejects these arguments: not a case of it
        return NOT_RUN
    base, pert = _tensors(out), _tensors(out2)
    if not base:
        return None
    claims = [mode.tags.get(t) for t in base]
    if len(base) != len(pert) or any(x.shape != y.shape for x, y in zip(base, pert, strict=True)):
        bad = [c for c in claims if c is None or c.known]
        return f"output shapes depend on one example, claimed {bad}" if bad else None
    n = e.a.shape[e.rows.dim] // e.rows.group  # examples
    for k, (x, y, r) in enumerate(zip(base, pert, claims, strict=True)):
        if r is not None and not r.known:
            continue
        changed = _changed(x, y)
        if r is None:
            if P.op_name(f) not in UNINITIALISED and bool(changed.any()):
                return f"output {k} claimed untagged (no rows of the batch) changes with one example"
            continue
        if r.dim >= x.dim() or x.shape[r.dim] != n * r.group:
            return f"output {k} of shape {tuple(x.shape)} claimed {r}"
        rows = changed.movedim(r.dim, 0).reshape(x.shape[r.dim], -1).any(1)
        others = rows.clone()
        others[EXAMPLE * r.group : (EXAMPLE + 1) * r.group] = False
        if bool(others.any()):
            where = others.nonzero().flatten().tolist()
            return f"output {k} claimed {r} but rows {where} of other examples change"
    return None


def test_every_rule_claims_at_least_the_mixing_it_does():
    problems, unrun = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for table, f, calls in _ops():
            name = P.op_name(f)
            if name in UNRUNNABLE:
                continue
            ran = False
            for i, call in enumerate(calls):
                for layout in LAYOUTS:
                    v = _violation(f, call, layout)
                    ran = ran or v is not NOT_RUN
                    if v and v is not NOT_RUN:
                        problems.append(f"{table} {f!r} call {i} ({layout}): {v}")
            if not ran:
                unrun.append(f"{table} {f!r}")
    assert not unrun, "operations with a rule that no call here runs (give them calls in CALLS):\n" + "\n".join(unrun)
    assert not problems, f"{len(problems)} claims do not hold:\n" + "\n".join(problems)


def test_the_tables_are_enumerated():
    """The check sees every table (a table added to provenance.py without a line here fails)."""
    tables = {
        n for n, v in vars(P).items() if n.isupper() and n[0] != "_" and isinstance(v, (set, frozenset, dict)) and v
    }
    tables -= {"HOST_READS", "HOST_SCALAR", "HOST_ROWS", "HOST_WHOLE", "HOST_READ_SITES"}  # tested below
    tables -= {"SIZED_BY_VALUES", "SIZE_TAKING"}  # refusals, not rules: test_bk_provenance.py
    tables -= {"MEMORY_EXPORTS"}  # the memory they alias, recorded: test_bk_provenance.py (aliases)
    tables -= {"DTYPE_OF_OTHER"}  # the operand they take no values from: test_bk_provenance.py (dtype donors)
    covered = set(TABLES) | {"NEW_TENSOR", "ROUTABLE"}
    assert tables <= covered, f"tables without their property check: {sorted(tables - covered)}"
    ruled = _functional_names()
    assert ruled >= RULED_BY_NAME, f"operations no longer ruled by name: {sorted(RULED_BY_NAME - ruled)}"
    unruled_fft = sorted(set(P.FFT) - set(P._NAMED_RULES))
    assert not unruled_fft, f"fft transforms without a rule: {unruled_fft}"
    nameless = sorted(n for n in ruled if not P._fns(n))
    assert not nameless, f"rules for names no torch, Tensor or torch.nn.functional operation has: {nameless}"
