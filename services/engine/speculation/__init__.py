"""Speculative decoding on the general path: draft K tokens and verify K + 1 positions
(``speculative.py``), choose the emitted tokens from the target's logits (``verify.py``),
and accept, recover or add a bonus token by rejection sampling (``rejection.py``). Any
batch runs here, penalties and pending min_tokens included; ``services.engine.device``
runs the batches the device can sample alone."""
