"""Book-keeping clipping (``grad_sample_mode="bk"``), one module per step of the mechanism:

1. :mod:`.provenance` — which tensors of the forward derive from the batch, and which of their rows
   belong to which example (a torch function mode active during the model's forward); :mod:`.replay` traces
   it once per signature of the forward and replays its answers on later forwards;
2. :mod:`.rules` — per-operation rules, one module per layer family: a trainable parameter meeting
   batch-derived rows (Linear, convolution, Embedding, the norms, transformers' Conv1D, RMSNorm forms):
   ghost norm or per-sample gradient;
3. :mod:`.shared` and :mod:`.tied` — values shared by the batch (parameters used directly,
   batch-independent inputs) and parameters used by several layers (cross terms);
4. :mod:`.plan` — which unit keeps each module owning trainable parameters (refusals before anything
   is attached); :mod:`.intercept` — what runs in place of a book-kept module's forward;
   :mod:`.units` — what is kept per module in the one backward pass (the :class:`~.units.Unit` protocol:
   a covered layer, a fallback, a direct unit);
5. :mod:`.keeper` — the book-keeper: the model's units, one backward pass, per-example norms and the
   clipped sum; :mod:`.module` — the user's module wrapping it (Opacus's interface).
"""
