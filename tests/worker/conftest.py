"""The worker's tests run the engine on the tiny random-weight checkpoint, as the engine's own tests do."""

from tests.engine.conftest import tiny_checkpoint, tiny_model_dir  # noqa: F401 - the fixtures, shared
