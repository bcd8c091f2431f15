"""Step 4, noise: Gaussian noise of std σ·c on the clipped sum, divided by Σ q_i (Boenisch et al. 2023,
Alg. 3 line 8).

``optimizer.py`` — Opacus's ``DPOptimizer`` with per-example clipping and the privacy hooks (the guard
before the noise, the ledger after it); ``randomness.py`` — the run's seeds and the sampler's and
noise's sources (seeded, or OS entropy in secure mode).
"""
