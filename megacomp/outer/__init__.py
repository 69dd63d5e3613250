"""Local-step outer loops over model replicas (issue 16): replicas train H steps on their own, then
exchange a compressed pseudo-gradient. Implemented: DiLoCo and Streaming DiLoCo (one engine, DiLoCo).
Planned on the same API: NoLoCo, MT-DAO, SparseLoCo."""
from .diloco import DiLoCo, DiLoCoConfig
from .groups import ReplicaGroups, build_replica_groups
from .liveness import ReplicaLost, ReplicaWatch

__all__ = ["DiLoCo", "DiLoCoConfig", "ReplicaGroups", "ReplicaLost", "ReplicaWatch", "build_replica_groups"]
