"""Sampling: each request's parameters (``params.py``), the per-row state of a logits batch
(``row_sampling.py``), logits to tokens (``sampler.py``: penalties, temperature, min_p,
top_k, top_p, logprobs) and counter-based noise, a pure function of (seed, position,
lane), so a draw does not depend on the batch it ran in (``noise.py``). Light: importing
``params`` loads no model."""
