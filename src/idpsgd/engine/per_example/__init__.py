"""Step 2, per-example norms: how each ``grad_sample_mode`` forms every example's gradient norm.

``wrap.py`` builds the mode's wrapper (the records are ``engine/modes.py``), ``unwrap.py`` finds the
user's module inside it, ``ghost.py`` is Opacus's ghost clipping with per-example clip norms,
``per_sample_rules.py`` corrects Opacus's rules the decomposition check found wrong, ``bk/`` is
book-keeping (provenance → rules → keeper; Bu et al. 2023), and ``norms.py`` / ``user_norms.py`` are the
norm passes outside a step (individual accounting and the individual filter).
"""
