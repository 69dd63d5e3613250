"""Local-step outer loops over model replicas: replicas train H steps on their own, then
exchange a compressed pseudo-gradient. Implemented: DiLoCo, Streaming DiLoCo and NoLoCo (one engine,
DiLoCo; NoLoCo's gossip step in noloco.py), MT-DAO (the engine's averaging plus mt_dao.py's moment averaging
and megacomp.optimizer.MultiTimescaleAdamW), with bounded waits for lost replicas (liveness.py).
SparseLoCo and SparseLoCo-DCT (sparseloco.py) and DCT-DiLoCo (dct_diloco.py) use the same API. LoCoDL (locodl.py:
local training plus unbiased compression of x_i - y with control variates, communicating with probability p) and LoDAdaC
(lodadac.py, the paper's Algorithm 1: local Adam-type steps plus compressed gossip through tracked copies over the
graphs of topology.py) have their own engines with the same step / state_dict / finish methods."""
from .diloco import DiLoCo, DiLoCoConfig
from .groups import ReplicaGroups, build_replica_groups
from .liveness import ReplicaLost, ReplicaWatch
from .locodl import LoCoDL, LoCoDLConfig
from .lodadac import LoDAdaC, LoDAdaCConfig

__all__ = ["DiLoCo", "DiLoCoConfig", "LoCoDL", "LoCoDLConfig", "LoDAdaC", "LoDAdaCConfig", "ReplicaGroups",
           "ReplicaLost", "ReplicaWatch", "build_replica_groups"]
