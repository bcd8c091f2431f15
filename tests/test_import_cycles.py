"""No two idpsgd modules import each other, also through imports inside
functions (``accounting/accountants.py`` ↔ ``prv.py`` over ``_check_min_sigma`` and
``training/loop.py`` ↔ ``pdp.py`` over ``resolve_device`` did: the shared piece moved down a layer,
to ``accounting/events.py`` and ``training/device.py``)."""

from __future__ import annotations

from support import import_edges


def test_no_two_modules_import_each_other():
    edges = import_edges()
    mutual = sorted({tuple(sorted((a, b))) for a, deps in edges.items() for b in deps if a in edges.get(b, ())})
    assert mutual == []
    assert "idpsgd.accounting.events" in edges["idpsgd.accounting.prv"]  # the shared check lives below both
    assert "idpsgd.training.device" in edges["idpsgd.training.pdp"]
