"""`python -m prefill_worker [flags]`: one prefill worker process (see engine/serving/worker_main.py)."""

import sys

from engine.serving.worker_main import serve_forever
from prefill_worker.worker import PrefillWorker

if __name__ == "__main__":
    sys.exit(serve_forever(PrefillWorker, None, ("prefill",)))
