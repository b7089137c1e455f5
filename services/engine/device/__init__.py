"""The device-resident decode step: CUDA graphs per batch bucket (``graphed_forward.py``,
``cuda_graphs.py``), the drafter's catch-up, the K-step draft chain and the target's verify
captured as one graph (``chain_catch_up.py``, ``draft_chain.py``, ``chain_verify.py``),
acceptance on the device with one host read per step (``device_step.py``), and whether a
step drafts at all (``adaptive_k.py``). Everything here is an optimisation of the general
path in ``services.engine.speculation``: its outputs are that path's, token for token."""
