"""``python -m train.bench`` (``train/bench/run.py``)."""

import sys

from train.bench.run import main

if __name__ == "__main__":
    sys.exit(main())
