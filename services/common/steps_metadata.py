"""The call metadata that binds a Decode or Generate call to a Steps stream
(``tandem.v1.WorkerStreams``, proto/tandem/v1/worker.proto): its value is the stream's
``stream_id``. The router sets it; the worker reads it (services/worker/step_streams.py)."""

STEPS_METADATA = "tandem-steps"
