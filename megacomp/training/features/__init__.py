"""The training families the pretraining loop can run, each one module (see megacomp.training.features.base for
the interface). ``FEATURES`` is the registry: its order is the order families are built in and the nesting of
their hooks (the first is the outermost). Adding a family is its module plus one line here.
"""
from .acco_overlap import ACCOOverlap
from .aqsgd_caches import AQSGDCaches
from .auto_compression import AutoCompression
from .base import Feature
from .demo_momentum import DeMoMomentum
from .error_probe import ErrorProbeFeature
from .fault_tolerance import FaultTolerance
from .lomo_fused import LomoFused
from .loqt_weights import LoQTWeights
from .onebit_adam import OneBitFamily
from .outer_loop import OuterLoop
from .zero_adamw import ZeROAdamW

FEATURES: tuple = (
    LoQTWeights,    # converts the model's linears before anything holds the parameters
    FaultTolerance,  # replica groups on torchft's quorum: joins it before anything of the iteration runs
    OuterLoop,      # replicas next: the inner optimizer works inside one (and MT-DAO picks its class)
    AQSGDCaches,    # activation caches handed to the pipeline's communicator
    ZeROAdamW,      # the optimizer families: exactly one is selected by --optimizer
    DeMoMomentum,
    OneBitFamily,
    LomoFused,
    ACCOOverlap,    # wraps the sharded AdamW built above
    AutoCompression,  # after the optimizer holds its channels; decides after the iteration, before the next
    ErrorProbeFeature,  # innermost: arms the channels' probe around the iteration's collectives
)
OPTIMIZERS = tuple(name for feature in FEATURES for name in feature.optimizer_names)
"""--optimizer's choices (each selects the family that names it)."""

__all__ = ["FEATURES", "OPTIMIZERS", "Feature"]
