"""The net under the engine's per-example machinery: a failure there is a refusal with a reason, never a crash.

The product guide's rule: "the engine's own machinery fails as a refusal with a reason, never as a crash".
Book-keeping's interception of the forward and its backward rules, provenance, Opacus's per-sample
gradients in hooks mode, ghost clipping's norm passes and the whole-module fallback's ``torch.func``
transform all run inside the user's forward and backward pass; an error raised there (a torch error on
an operation the machinery cannot transform, a bug) would reach the user as a traceback of the engine's
internals.  Here every such error becomes :class:`MachineryRefusal`, one line naming the layer (or the
operation) and the original error's type and message, which the CLI turns into exit 2.

Two directions are kept apart:

* an error the user's model raises on its own is **not** relabelled: when a private forward raises,
  :func:`forward_net` runs the same forward again without the engine (its interception off); if that
  raises too, the original error propagates unchanged;
* the engine's refusals (:class:`~idpsgd.validation.InvalidParameterError`, provenance's
  ``RefusedRows``, this class) and the errors idpsgd raises on purpose with a message for the user pass as
  they are (a plain ``RuntimeError`` of idpsgd's own becomes this class, its message unchanged); an error
  Opacus raises on purpose inside the machinery (``NotImplementedError``: parameter tying under ghost
  clipping, a layer reused) becomes this class *and* stays an instance of its own class.

All of this happens in the forward, the backward or before the noise of ``optimizer.step()``: a refused
step draws no noise and charges nothing, as every other refusal before the noise (``docs/inside-the-engine.md``).
"""

from __future__ import annotations

import contextlib
import linecache
import os

from ...validation import InvalidParameterError
from .bk.provenance import RefusedRows


class MachineryRefusal(RuntimeError):
    """The engine's per-example machinery cannot handle a layer or an operation of the model: refused,
    with the layer or operation and the original error named (the CLI's exit 2)."""


#: errors that are refusals already: never relabelled
REFUSALS = (InvalidParameterError, RefusedRows, MachineryRefusal)
#: error types a ``raise`` written for the user never uses: raised in idpsgd's own code, they are bugs
_BUGS = (TypeError, AttributeError, IndexError, KeyError, NameError, AssertionError, ArithmeticError, StopIteration)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/idpsgd
#: torch, Opacus and idpsgd: a line outside them and Python's own library is the model's code
_LIBRARIES = tuple(os.path.dirname(os.path.abspath(m.__file__)) for m in (__import__("torch"), __import__("opacus")))
_LIBRARIES += (_PACKAGE,)
_OPACUS = _LIBRARIES[1]
_STDLIB = os.path.dirname(os.path.abspath(contextlib.__file__))


def _library(path: str) -> bool:
    return path.startswith(_LIBRARIES) or (path.startswith(_STDLIB) and "-packages" not in path)


def _frames(exc: BaseException):
    tb = exc.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _in(tb, packages) -> bool:
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(packages)


def _deliberate(exc: BaseException, *packages) -> bool:
    """Raised by a ``raise`` of idpsgd's own code (or of ``packages``: Opacus's refusals in hooks and ghost
    mode) with a message for the user, not a bug of it."""
    last = None
    for tb in _frames(exc):
        last = tb
    text = str(exc)
    return (
        last is not None
        and _in(last, (_PACKAGE, *packages))
        and not isinstance(exc, _BUGS)
        and "values to unpack" not in text
    )


def _user_line(exc: BaseException) -> str | None:
    """The innermost line of the user's code (outside torch, Opacus, idpsgd and Python's library) the error
    passed through, as ``file.py:line `source```."""
    found = None
    for tb in _frames(exc):
        path = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not _library(path):
            source = linecache.getline(path, tb.tb_lineno).strip()
            found = f"{os.path.basename(path)}:{tb.tb_lineno}" + (f" `{source}`" if source else "")
    return found


def _layer_of(exc: BaseException, names: dict) -> str | None:
    """The innermost module of the model whose call the error passed through, as ``layer 'name' (Type)``."""
    found = None
    for tb in _frames(exc):
        module = tb.tb_frame.f_locals.get("self")
        if module is not None and id(module) in names:
            found = f"layer {names[id(module)]!r} ({type(module).__name__})"
    return found


def module_names(model) -> dict:
    """id(module) → its name in ``model`` (the model itself: its class name)."""
    return {id(m): (n or type(m).__name__) for n, m in model.named_modules()}


_ALSO: dict = {}


def _also(original: type) -> type:
    """:class:`MachineryRefusal` that is also an ``original`` (an error class Opacus raises on purpose, e.g.
    ``NotImplementedError``: code written for Opacus catches it as before), where the two classes combine."""
    cls = _ALSO.get(original)
    if cls is None:
        try:
            cls = type("MachineryRefusal", (MachineryRefusal, original), {"__module__": __name__})
        except TypeError:  # an incompatible layout (AttributeError's name and obj)
            cls = MachineryRefusal
        _ALSO[original] = cls
    return cls


def refusal(exc: BaseException, where: str, mode: str) -> MachineryRefusal:
    """``exc`` as the engine's refusal: one line naming ``where`` (a layer, an operation) and the original error."""
    if _deliberate(exc) and type(exc) is RuntimeError:  # idpsgd's own reason: kept word for word
        return MachineryRefusal(str(exc))
    first = (str(exc).strip().splitlines() or [""])[0]
    cls = _also(type(exc)) if _deliberate(exc, _OPACUS) else MachineryRefusal
    return cls(
        f"grad_sample_mode={mode!r}: the engine's per-example machinery failed at {where}: "
        f"{type(exc).__name__}: {first} — refused (the model runs without the engine there); another "
        "grad_sample_mode may cover it"
    )


def passes(exc: BaseException) -> bool:
    """Whether ``exc`` propagates as it is: a refusal already, or an error idpsgd raised on purpose that is not a
    plain ``RuntimeError`` (a ``ValueError`` for a misuse, e.g. two backward passes before a step)."""
    return isinstance(exc, REFUSALS) or (_deliberate(exc) and type(exc) is not RuntimeError)


class guard:  # lower case: used as a function, ``with guard(where, mode):``
    """Code of the engine's own machinery (a backward rule, a grad sampler, a norm pass): any error that is not
    already a refusal becomes :class:`MachineryRefusal` naming ``where`` (a string, or a callable giving it).
    A plain class, not ``contextlib.contextmanager``: it wraps every book-kept layer's backward (~0.3 µs)."""

    __slots__ = ("mode", "where")

    def __init__(self, where, mode: str):
        self.where, self.mode = where, mode

    def __enter__(self):
        return self

    def __exit__(self, _type, exc, _tb):
        if exc is None or not isinstance(exc, Exception) or passes(exc):
            return False
        where = self.where() if callable(self.where) else self.where
        raise refusal(exc, where, self.mode) from exc


def forward_net(call, plain, model, mode: str, args, kwargs):
    """``call(*args, **kwargs)``, the model's private forward; an error it raises is the user's when the same
    forward raises without the engine (``plain``: a context in which the engine does not intercept), and
    propagates unchanged then; otherwise it is the machinery's and becomes :class:`MachineryRefusal` naming
    the innermost layer of the model and the line of the model's code it was raised at."""
    try:
        return call(*args, **kwargs)
    except Exception as exc:
        if passes(exc):
            raise
        failed_alone = False
        with plain():
            try:
                model(*args, **kwargs)
            except Exception:  # any error of the model alone: the original is the user's
                failed_alone = True
        if failed_alone:
            raise
        where = " at ".join(w for w in (_layer_of(exc, module_names(model)), _user_line(exc)) if w)
        raise refusal(exc, where or "the model's forward", mode) from exc


__all__ = ["REFUSALS", "MachineryRefusal", "forward_net", "guard", "module_names", "passes", "refusal"]
