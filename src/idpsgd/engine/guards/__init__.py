"""The guards around the step: what is refused before the noise, or at the first forward pass.

``step_guard.py`` — the guards the optimizer runs before the noise; ``integrity.py`` — un-noised writes
to the released model; ``batch_independence.py`` and ``padding_check.py`` — examples that mix within a
batch; ``decomposition.py`` — per-example gradients that do not add up to autograd's.
"""
