import os

# One intra-op thread per process: ranks share two cores, and forked ranks must not inherit an
# OpenMP pool (libgomp is not fork-safe once a parallel region ran).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
