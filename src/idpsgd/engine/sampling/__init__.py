"""Step 1, sample rows: Poisson sampling at per-unit rates q_i (Boenisch et al. 2023, Alg. 3 line 3).

``sampler.py`` — one :class:`~.sampler.PoissonBatchSampler` (examples or users; one process or a rank's
shard), the queue of drawn indices the clipping reads, and the private data loader;
``rank_balance.py`` — which rank samples which unit (snake order of the rates: equal expected loads).
"""
