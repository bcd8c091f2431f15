"""Adapters to other frameworks on the privacy engine (:class:`~idpsgd.engine.IndividualizedPrivacyEngine`).

* :mod:`idpsgd.integrations.hf` — Hugging Face ``transformers.Trainer`` with per-example budgets
  (``pip install idpsgd[hf]``).

Each adapter asks the engine for the private step (its Poisson sampler, clipping optimizer,
accountant and filter) and never builds its own.  Their third-party imports are optional extras,
imported only when the adapter is used; nothing in the rest of idpsgd imports them.
"""
