"""The worker runtime every role shares: a worker around one engine (``worker.py``), its
engine thread (``engine_loop.py``), its RankInfo and the endpoint it publishes
(``rank_info.py``, ``transfer_proto.py``), pairing (``peering.py``, ``tp_check.py``),
registration with every router replica (``router_links.py``), the tensor-parallel rank
group (``tp_*.py``), engine outputs as protos (``outputs.py``) and the engine-step profiler
(``step_profile.py``). It loads torch and the engine; the router never imports it (what
both sides share is ``services.common``)."""
