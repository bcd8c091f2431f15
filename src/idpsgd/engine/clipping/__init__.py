"""Step 3, clip: each drawn example's gradient scaled by min(1, c_i/‖g_i‖) (Boenisch et al. 2023, Alg. 3
line 6, *Scale*: its own c_i).

``examples.py`` — :class:`~.examples.PerExampleClipping`, the clip norms of the drawn examples;
``users.py`` — user level: a user's rows summed and clipped as one (every mode's way to form that sum).
"""
