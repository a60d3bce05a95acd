"""`python -m prefill_worker [flags]`: one prefill worker process (see worker/main.py)."""

import sys

from prefill_worker.worker import PrefillWorker
from worker.main import serve_forever

if __name__ == "__main__":
    sys.exit(serve_forever(PrefillWorker, None, ("prefill",)))
