"""`python -m decode_worker [--role decode|colocated] [flags]`: one decode (or colocated) worker process."""

import sys

from decode_worker.worker import DecodeWorker
from worker.main import serve_forever

if __name__ == "__main__":
    sys.exit(serve_forever(DecodeWorker, None, ("decode", "colocated")))
