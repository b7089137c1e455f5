"""Text and token ids, torch-free: the model's own tokenizer (``tokenizer.py``) and the
incremental detokenizer of streamed output (``detokenizer.py``). The router and the engine
both import it; it imports neither."""
