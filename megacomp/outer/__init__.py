"""Local-step outer loops over model replicas: replicas train H steps on their own, then
exchange a compressed pseudo-gradient. Implemented: DiLoCo, Streaming DiLoCo and NoLoCo (one engine,
DiLoCo; NoLoCo's gossip step in noloco.py), MT-DAO (the engine's averaging plus mt_dao.py's moment averaging
and megacomp.optimizer.MultiTimescaleAdamW), with bounded waits for lost replicas (liveness.py).
SparseLoCo and DCT-momentum DiLoCo (sparseloco.py) use the same API."""
from .diloco import DiLoCo, DiLoCoConfig
from .groups import ReplicaGroups, build_replica_groups
from .liveness import ReplicaLost, ReplicaWatch

__all__ = ["DiLoCo", "DiLoCoConfig", "ReplicaGroups", "ReplicaLost", "ReplicaWatch", "build_replica_groups"]
