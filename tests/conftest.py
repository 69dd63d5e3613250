import os
import sys

# One intra-op thread per process: ranks share two cores, and forked ranks must not inherit an
# OpenMP pool (libgomp is not fork-safe once a parallel region ran).
os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # tests/distributed.py, tests/codec_bounds.py
sys.path.insert(0, os.path.dirname(HERE))  # test the checkout this file is in, whatever is installed

import torch  # noqa: E402

torch.set_num_threads(1)
