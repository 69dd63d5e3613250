"""Configuration dataclasses: model parallelism and communication compression per traffic path.

Both load from plain dicts / YAML (unknown keys raise, naming the allowed ones) and write back with
``to_dict()`` so a checkpoint can record exactly what ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Optional

import torch

from .comm import AnyChannel, Channel, CommOptions, HopCodecs, hop_codecs, make_channel
from .comm.hop_groups import is_hop_mapping, make_hop_codecs
from .compression import (Accordion, Codec, CodecLike, ErrorFeedbackConfig, PowerSGD, check_error_feedback_codec,
                          check_own_error_feedback, make_codec, make_compressor, make_error_feedback_config,
                          parse_codec_arg)
from .compression.ladder import AutoCodecConfig
from .compression.learned import LGC, LGCPCA
from .compression.unbiased import UnbiasedCodec, make_unbiased_codec, unbiased_name

_EF_PATHS = ("tp_backward", "pp_gradient", "dp_gradient")  # the paths that may use error feedback
TRAFFIC_PATHS = ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter",
                 "pp_activation", "pp_gradient", "dp_gradient", "dp_parameter")
"""The paths every run has: always a codec after construction (identity when not set); one channel each
in :class:`Channels`."""
FEATURE_PATHS = ("dp_momentum", "outer", "loqt_merge", "loqt_merge_tp", "replicas")
"""The paths of optional training features (1-bit optimizers, outer loops, LoQT, torchft's replica groups): None
when not set, which
means the feature's own default (see each field); the feature builds its channel with
``megacomp.comm.make_channel``."""
HOP_PATHS = ("dp_gradient", "dp_parameter")
"""The paths that may set a codec per link kind (``{inter_node: int4, intra_node: none}``): the data-parallel
exchanges, which run hop by hop when the DP group spans nodes with several of its ranks on each."""
ALL_TRAFFIC_PATHS = TRAFFIC_PATHS + FEATURE_PATHS
"""Every traffic path a config can set (what a banner lists)."""
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _check_keys(cls, data: Mapping[str, Any]) -> None:
    allowed = {f.name for f in fields(cls) if f.init}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {sorted(unknown)}; allowed keys: {sorted(allowed)}")


@dataclass
class CommCompressionConfig:
    """A codec per traffic path, error feedback, the small-tensor policy and the transport options.

    Each path of TRAFFIC_PATHS accepts None, a name, a mapping, a string holding a YAML mapping or a Codec
    (megacomp.compression.parse_codec_arg) and holds a ``Codec`` after construction (identity for None:
    normalised here, once); :meth:`build_channels` turns them into one :class:`megacomp.comm.Channel` per path.
    ``to_dict`` writes the identity as None. The FEATURE_PATHS (dp_momentum, outer, loqt_merge, loqt_merge_tp)
    accept the same forms but keep None as *not set*, meaning the default of the feature that uses the path
    (see each field); the training layer resolves them and builds their channels with :meth:`channel`.
    """

    tp_forward: Optional[CodecLike] = None
    """Forward all-reduce of tensor-parallel partial outputs (RowParallelLinear, VocabParallelEmbedding) and
    the all-gather of ColumnParallelLinear(gather_output=True)."""
    tp_backward: Optional[CodecLike] = None
    """Every tensor-parallel collective of the backward pass: the all-reduce of ColumnParallelLinear's input
    gradient, and under sequence parallelism the gradient reduce-scatter / all-gather."""
    sp_all_gather: Optional[CodecLike] = None
    """Forward all-gather of sequence-parallel activations (ColumnParallelLinear input)."""
    sp_reduce_scatter: Optional[CodecLike] = None
    """Forward reduce-scatter of sequence-parallel partial outputs (RowParallelLinear output)."""
    pp_activation: Optional[CodecLike] = None
    """Activations sent forward between pipeline stages."""
    pp_gradient: Optional[CodecLike] = None
    """Activation gradients sent backward between pipeline stages."""
    dp_gradient: Optional[CodecLike] = None
    """Data-parallel gradient reduce-scatter / all-reduce: a codec (on the slowest link the DP group crosses; a DP
    group with several ranks on each of several nodes reduces inside each node first, uncompressed, then across
    nodes with this codec: megacomp.comm.hierarchical), a codec per link kind (``{inter_node: {name: int4,
    block_size: 128}, intra_node: bf16}``; links not named travel uncompressed), PowerSGD settings
    (``{name: powersgd, rank: 4}``; megacomp.compression.low_rank), which bring their own error feedback, or
    Accordion settings (``{name: accordion, low: ..., high: ..., eta: 0.5, interval: 10}``) switching
    between two such levels; or learned gradient compression as published (``{name: lgc, variant: ps}``: top-k
    plus an autoencoder of the top-k values; megacomp.compression.lgc) or its chunked PCA / MLP reading
    (``{name: lgc_pca, latent: 32, chunk: 512}``; megacomp.compression.learned), each with its own error feedback."""
    dp_parameter: Optional[CodecLike] = None
    """Data-parallel parameter all-gather after the sharded optimizer step: a codec (on the slowest link the DP
    group crosses, as dp_gradient) or a codec per link kind."""
    tp_backward_error_feedback: Optional[Any] = None
    """Error feedback ('ef', 'loco' or a mapping) on the tp_backward collectives, one state per layer.
    Sound only when a layer sees the same activation shape every step (it carries one step's
    quantization residual into the next step's gradient, as Optimus-CC does for pipeline gradients).
    Forward activations never use error feedback: the residual would corrupt the next batch's values."""
    pp_gradient_error_feedback: Optional[Any] = None
    """Error feedback on pipeline gradient sends, keyed by stage boundary and micro-batch slot."""
    pp_activation_delta: bool = False
    """AQ-SGD (megacomp.pipeline_parallel.aqsgd): pp_activation sends each sample's change since its last
    visit, quantised with the pp_activation codec, against a per-sample cache on both sides of every stage
    boundary. Needs stable sample ids and repeated epochs (fine-tuning); pretraining sizes and checks the
    caches. Off: activations are quantised directly."""
    pp_activation_delta_warmup_visits: int = 1
    """AQ-SGD: visits of a sample that send its activation uncompressed (AQ-SGD's warm-up epochs); >= 1."""
    pp_activation_delta_warmup_full_gradients: bool = False
    """AQ-SGD: gradients of an iteration with a sample in warm-up travel uncompressed too, as in the reference
    code's warm-up epochs (DS3Lab/AC-SGD switches every compressor off). False: pp_gradient's codec throughout."""
    pp_activation_delta_bits: int = 0
    """AQ-SGD: 1..8 quantises the deltas with the reference code's quantiser at this many bits (one fp16 max-scale
    per hidden channel over the micro-batch, 2^bits levels; megacomp.compression.channel_max) instead of the
    pp_activation codec, which must then stay unset. 0: the pp_activation codec."""
    dp_gradient_error_feedback: Optional[Any] = None
    """Error feedback on data-parallel gradients ('loco' recommended with int4)."""
    dp_gradient_warmup_steps: int = 0
    """Optimizer steps whose data-parallel gradients travel uncompressed before dp_gradient starts
    (1-bit Adam's full-precision warm-up; pair it with adam_freeze_variance_step)."""
    min_compress_numel: int = 65536
    """Tensors with fewer elements travel uncompressed (logged once per path): below this size the
    codec's cost and the per-message latency outweigh the bytes saved."""
    segment_numel: Optional[int] = None
    """Elements per pipelining segment of the compressed collectives (0: never segment). It changes the
    numbers (segments start new scale blocks), so it is recorded with the config and a checkpoint
    written with another value is refused. None: ``MEGACOMP_PIPELINE_NUMEL`` or 1M, read now."""
    error_probe_interval: int = 0
    """Measure every path's compression error on one iteration in this many (and on the first): each compressed
    call of that iteration is also run uncompressed and compared (megacomp.comm.probe); pretraining logs the
    relative error per path and per call (layer) in metrics.jsonl under ``probe``. Never changes results;
    costs one uncompressed collective per probed call (counted as ``probe_bytes``, not as traffic). 0: off."""
    auto: Optional[Any] = None
    """``--compression auto``: a ladder of value codecs per traffic path, the decision interval, a step-time target
    and an error budget (megacomp.compression.ladder.AutoCodecConfig; ``{}`` takes its defaults). Each laddered path
    starts on its first rung and switches at run time to the least lossy rung whose measured-link transfer hides
    behind compute or meets the target (megacomp.training.features.auto_compression). A laddered path's own field
    must stay unset; its ``*_error_feedback`` applies on every lossy rung. None: every codec is fixed at launch."""
    duplex: Optional[bool] = None
    """Compressed bytes as direction-split p2p (True), backend collectives (False) or by backend (None:
    p2p on gloo); same results either way. None also lets ``MEGACOMP_DUPLEX`` decide."""

    # -- the paths of optional features: None = not set = the feature's own default (kept None here) -------------
    dp_momentum: Optional[CodecLike] = None
    """Momentum exchange of the 1-bit optimizers (1-bit Adam / LAMB after the freeze, 0/1 Adam's 1-bit gradients and
    synchronisations; megacomp.optimizer.onebit), a value codec. Not set: the optimizers' default
    ``{name: sign, block_size: 0}`` (megacomp.optimizer.onebit.DEFAULT_MOMENTUM_CODEC); ``none``: uncompressed."""
    dp_momentum_error_feedback: Optional[bool] = None
    """Worker and server error feedback (classic) on the dp_momentum exchange. Not set: on for a lossy codec
    (including the default sign codec), off for ``none``; True / False decide explicitly (True needs a lossy
    codec)."""
    outer: Optional[CodecLike] = None
    """Pseudo-gradient exchange of the outer loops over replicas (DiLoCo, Streaming DiLoCo, NoLoCo, MT-DAO,
    SparseLoCo, LoDAdaC's gossip, LoCoDL's d_i; megacomp.outer). Not set: uncompressed, except SparseLoCo's default
    ``{name: int2, k: 64, chunk: 4096}`` (megacomp.outer.sparseloco.DEFAULT_CODEC); ``none``: uncompressed. LoCoDL
    takes the unbiased compressors here (``randk`` with ``k``, ``usq2``, ``usq4``, ``usq8``;
    megacomp.compression.unbiased), which no other outer algorithm accepts."""
    outer_error_feedback: Optional[Any] = None
    """Error feedback ('ef', 'loco' or a mapping) on the outer exchange, as the other ``*_error_feedback`` fields
    (None: off). Needs ``outer`` set to a lossy codec; SparseLoCo refuses it (its accumulator is its error
    feedback)."""
    loqt_merge: Optional[CodecLike] = None
    """LoQT's data-parallel sum of each layer's captured weight gradient at a merge step
    (megacomp.tensor_parallel.loqt). Not set: uncompressed."""
    loqt_merge_tp: Optional[CodecLike] = None
    """LoQT's tensor-parallel all-reduce of each layer's Gram matrix at a merge step (fp64; its top eigenvectors
    are the new projection). Not set: uncompressed. The overflow flag and the compensation's error norms
    always travel uncompressed."""
    replicas: Optional[CodecLike] = None
    """Traffic between replica groups under ``--fault-tolerance torchft`` (megacomp.integrations.torchft), over
    torchft's quorum: the averaged gradient shards of every step, or the pseudo-gradients under
    ``--ft-outer-steps``; often the slowest link of the run (between sites). Not set: the ``dp_gradient`` codec per
    step, the ``outer`` codec under ``--ft-outer-steps`` (uncompressed when that is not set either);
    ``--ft-codec`` overrides it; ``none``: uncompressed."""
    replicas_error_feedback: Optional[Any] = None
    """Error feedback ('ef', 'loco' or a mapping) on the ``replicas`` path, as the other ``*_error_feedback`` fields.
    Not set: the error feedback that goes with the codec's default (``dp_gradient_error_feedback`` or
    ``outer_error_feedback``) when ``replicas`` is not set, off when it is. Needs a lossy ``replicas`` codec."""

    def __post_init__(self) -> None:
        for name in TRAFFIC_PATHS:
            spec = getattr(self, name)
            spec = spec if isinstance(spec, HopCodecs) else parse_codec_arg(spec)
            if isinstance(spec, HopCodecs) or is_hop_mapping(spec):
                if name not in HOP_PATHS:
                    raise ValueError(f"{name}: a codec per link kind applies to {' and '.join(HOP_PATHS)} (the "
                                     f"exchanges that run hop by hop); give {name} one codec")
                setattr(self, name, make_hop_codecs(spec, name))
                continue
            make = make_compressor if name == "dp_gradient" else make_codec
            setattr(self, name, make(spec))
        self._check_feature_paths()
        self._check_auto()
        env = CommOptions.from_env()
        if self.segment_numel is None:
            self.segment_numel = env.segment_numel
        if self.duplex is None:
            self.duplex = env.duplex
        CommOptions(duplex=self.duplex, segment_numel=self.segment_numel)  # raises on bad values
        for name in ("tp_backward_error_feedback", "pp_gradient_error_feedback", "dp_gradient_error_feedback"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, make_error_feedback_config(value))
        if not isinstance(self.dp_gradient_warmup_steps, int) or self.dp_gradient_warmup_steps < 0:
            raise ValueError(f"dp_gradient_warmup_steps must be an int >= 0, got {self.dp_gradient_warmup_steps!r}")
        if self.min_compress_numel < 0:
            raise ValueError(f"min_compress_numel must be >= 0, got {self.min_compress_numel}")
        if not isinstance(self.error_probe_interval, int) or self.error_probe_interval < 0:
            raise ValueError(f"error_probe_interval must be an int >= 0 (iterations between compression-error probes; "
                             f"0 = off), got {self.error_probe_interval!r}")
        if not isinstance(self.pp_activation_delta_warmup_visits, int) or self.pp_activation_delta_warmup_visits < 1:
            raise ValueError(f"pp_activation_delta_warmup_visits must be an int >= 1 (the first visit fills AQ-SGD's "
                             f"cache), got {self.pp_activation_delta_warmup_visits!r}")
        self._check_delta_options()
        check_own_error_feedback(_ef_codec(self.build_spec("dp_gradient")), self.dp_gradient_error_feedback,
                                 "dp_gradient", "dp_gradient_error_feedback")
        for path in _EF_PATHS:
            check_error_feedback_codec(_ef_codec(self.build_spec(path)), getattr(self, path + "_error_feedback"),
                                       f"{path}_error_feedback (path {path})")

    def _check_delta_options(self) -> None:
        """AQ-SGD's reference options: one line per problem."""
        bits = self.pp_activation_delta_bits
        if not isinstance(bits, int) or isinstance(bits, bool) or not 0 <= bits <= 8:
            raise ValueError(f"pp_activation_delta_bits must be an int in 0..8 (0: the pp_activation codec), got {bits!r}")
        if (bits or self.pp_activation_delta_warmup_full_gradients) and not self.pp_activation_delta:
            raise ValueError("pp_activation_delta_bits / pp_activation_delta_warmup_full_gradients set AQ-SGD's options: "
                             "set pp_activation_delta: true, or drop them")
        if bits and not (isinstance(self.pp_activation, Codec) and self.pp_activation.is_identity):
            raise ValueError(f"pp_activation_delta_bits: {bits} quantises AQ-SGD's deltas itself; leave pp_activation "
                             f"unset (it is {self.pp_activation}), or set pp_activation_delta_bits: 0 to use it")

    def _check_auto(self) -> None:
        """Read the ``auto`` block and check its ladders against this config (one line per problem)."""
        if self.auto is None:
            return
        self.auto = AutoCodecConfig.from_value(self.auto)
        why_not = {p: (f"is set to {getattr(self, p)} and laddered by auto: drop one (a laddered path's codec is "
                       f"chosen at run time)") for p in self.auto.ladder
                   if p in TRAFFIC_PATHS and not (isinstance(getattr(self, p), Codec) and getattr(self, p).is_identity)}
        if self.pp_activation_delta:
            why_not.setdefault("pp_activation", "sends AQ-SGD's deltas against caches built with one codec "
                                                "(pp_activation_delta): drop pp_activation from the ladder or the delta")
        self.auto.check(TRAFFIC_PATHS, why_not)

    def build_spec(self, path: str):
        """The setting ``path``'s channel is built with: its field, or for a path laddered by ``auto`` the most
        lossy rung within the error budget (so its buckets, residual keys and streams exist from the start; the
        controller sets the first rung before the first iteration)."""
        if self.auto is not None and path in self.auto.ladder:
            return self.auto.allowed(path)[-1]
        return getattr(self, path)

    def _check_feature_paths(self) -> None:
        """Build the codecs of the feature paths that are set (None stays None) and check their settings."""
        for name in FEATURE_PATHS:
            value = getattr(self, name)
            if value is not None:
                spec = parse_codec_arg(value)
                if name == "outer" and unbiased_name(spec) is not None:  # LoCoDL's compressors (checked there)
                    self.outer = make_unbiased_codec(spec)
                    continue
                codec = make_codec(spec)
                if codec.structured and name != "outer":  # only the outer loops' all-gather carries top-k / DCT
                    raise ValueError(f"{name}: codec {codec} selects or transforms entries; this path needs a value "
                                     f"codec (sign, int2, int4, int8, fp8_*, bf16, none)")
                setattr(self, name, codec)
        ef = self.dp_momentum_error_feedback
        if ef is not None and not isinstance(ef, bool):
            raise ValueError(f"dp_momentum_error_feedback must be true, false or unset (on for a lossy codec), got {ef!r}")
        if ef and self.dp_momentum is not None and self.dp_momentum.is_identity:
            raise ValueError("dp_momentum_error_feedback is true but dp_momentum is 'none': error feedback needs a lossy "
                             "codec; set dp_momentum_error_feedback false (or leave it unset), or pick a codec such as sign")
        if self.outer_error_feedback is not None:
            self.outer_error_feedback = make_error_feedback_config(self.outer_error_feedback)
            if self.outer is None:
                raise ValueError("outer_error_feedback needs a lossy outer codec, and outer is not set (uncompressed, or "
                                 "SparseLoCo's accumulator, which is its own error feedback); set outer, e.g. int4")
            if isinstance(self.outer, UnbiasedCodec):
                raise ValueError(f"outer_error_feedback with the unbiased outer codec {self.outer.name}: LoCoDL's control "
                                 f"variates correct its compression error; drop outer_error_feedback")
            check_error_feedback_codec(self.outer, self.outer_error_feedback, "outer_error_feedback (path outer)")
        if self.replicas_error_feedback is not None:
            self.replicas_error_feedback = make_error_feedback_config(self.replicas_error_feedback)
            if self.replicas is None:
                raise ValueError("replicas_error_feedback needs a lossy replicas codec, and replicas is not set; set "
                                 "replicas (e.g. int8) or drop replicas_error_feedback")
            check_error_feedback_codec(self.replicas, self.replicas_error_feedback,
                                       "replicas_error_feedback (path replicas)")

    def options(self) -> CommOptions:
        """The transport options every channel of this config gets (validation on)."""
        return CommOptions(validate=True, duplex=self.duplex, segment_numel=self.segment_numel)

    def build_channels(self, groups=None, dp_hierarchy=None, dp_link: Optional[str] = None) -> "Channels":
        """One :class:`megacomp.comm.Channel` per traffic path, each owning its error-feedback state; built once
        per run (per rank: call on ``for_rank(rank)`` for per-rank seeds). ``groups``: a
        ``parallel_state.ProcessGroups`` whose tp/dp groups become the channels' default groups (None:
        callers pass their group per call). ``dp_hierarchy``: the DP group's hops (a
        megacomp.comm.HierarchicalGroup over ``groups.dp``): the DP paths then run hop by hop, the path's codec on the
        slowest hop (or one per hop). ``dp_link``: the one link kind a flat DP group crosses, which picks a per-hop
        setting's codec for it (None: a per-hop setting needs ``dp_hierarchy``).

        Raises:
            ValueError: a per-hop setting naming a hop the DP group does not cross, or one without ``dp_hierarchy``
                or ``dp_link``."""
        opts = self.options()
        tp = getattr(groups, "tp", None)
        dp = getattr(groups, "dp", None) if dp_hierarchy is None else dp_hierarchy
        group_of = {"tp_forward": tp, "tp_backward": tp, "sp_all_gather": tp, "sp_reduce_scatter": tp,
                    "pp_activation": None, "pp_gradient": None, "dp_gradient": dp, "dp_parameter": dp}
        specs = {path: self.build_spec(path) for path in TRAFFIC_PATHS}
        for path in HOP_PATHS:
            if isinstance(specs[path], HopCodecs) and dp_hierarchy is None:
                if dp_link is None:
                    raise ValueError(f"{path} sets a codec per link kind ({specs[path]}), but the run's topology is "
                                     f"not known here; give {path} one codec")
                specs[path] = hop_codecs(specs[path], (dp_link,), path)[dp_link]  # the one hop a flat group has
        return Channels(**{path: self.channel(path, specs[path], group=group_of[path],
                                              error_feedback=getattr(self, path + "_error_feedback", None),
                                              options=opts)
                           for path in TRAFFIC_PATHS})

    def channel(self, path: str, spec: Any, *, group=None, error_feedback: Any = None,
                options: Optional[CommOptions] = None) -> AnyChannel:
        """The channel of ``path`` for the setting ``spec`` (megacomp.comm.make_channel) with this config's
        small-tensor rule and, unless ``options`` is given, its transport options (:meth:`options`). For a
        feature path pass its resolved setting (a field that is None means the feature's default, which only the
        feature knows). Raises ValueError as make_channel."""
        if path not in ALL_TRAFFIC_PATHS:
            raise ValueError(f"unknown traffic path {path!r}; the paths are {', '.join(ALL_TRAFFIC_PATHS)}")
        return make_channel(path, spec, group=group, error_feedback=error_feedback,
                            min_compress_numel=self.min_compress_numel,
                            options=options if options is not None else self.options(),
                            error_feedback_arg=f"{path}_error_feedback")

    def for_rank(self, rank: int) -> "CommCompressionConfig":
        """This config with every seeded codec's seed offset by ``rank`` (seed + rank * 1000003): a YAML seed
        is the same on every rank, and equal seeds give every rank the same stochastic-rounding draws, so
        the ranks' rounding errors would add up coherently instead of averaging out. Rank 0 keeps the seed;
        unseeded codecs are unchanged. Checkpoints record the config before this step. The FEATURE_PATHS keep
        their seeds, as their features always did with the codecs they were given."""
        out = replace(self)
        if self.auto is not None:
            out.auto = self.auto.for_rank(rank)
        for name in TRAFFIC_PATHS:
            codec = getattr(self, name)
            if isinstance(codec, Accordion) and not codec.low_rank:  # its codec levels' seeds, as a plain codec's
                levels = {w: getattr(codec, w) for w in ("low", "high")}
                levels = {w: make_codec(c, seed=c.seed + rank * 1000003) if c.seed is not None else c
                          for w, c in levels.items()}
                setattr(out, name, replace(codec, **levels))
            if isinstance(codec, Codec) and codec.seed is not None:  # PowerSGD's seed must stay equal on every rank
                setattr(out, name, make_codec(codec, seed=codec.seed + rank * 1000003))
        return out

    @property
    def enabled(self) -> bool:
        """Whether any traffic path has a lossy codec (a feature path counts when it is set)."""
        return self.auto is not None or any(getattr(self, p) is not None and not getattr(self, p).is_identity
                                            for p in ALL_TRAFFIC_PATHS)

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "CommCompressionConfig":
        """Build from a YAML mapping. Raises ValueError naming unknown keys and the allowed ones."""
        data = dict(data or {})
        _check_keys(cls, data)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON) that rebuilds this config; identity codecs of the TRAFFIC_PATHS are written as None.
        A feature path (and its error-feedback field) is written only when set, an explicit identity as ``'none'``,
        so an unset path stays unset and configs recorded before these fields existed stay equal."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in FEATURE_PATHS or f.name in ("dp_momentum_error_feedback", "outer_error_feedback",
                                                     "replicas_error_feedback"):
                if value is None:
                    continue
                if isinstance(value, Codec) and value.is_identity:
                    out[f.name] = "none"
                    continue
            if isinstance(value, Codec):
                value = None if value.is_identity else value.to_dict()
            elif isinstance(value, (PowerSGD, Accordion, HopCodecs)):
                value = value.to_dict()
            elif isinstance(value, UnbiasedCodec):  # LoCoDL's outer compressor
                value = value.to_dict()
            elif isinstance(value, (LGC, LGCPCA)):  # learned gradient compression settings (dp_gradient)
                value = value.to_dict()
            elif isinstance(value, AutoCodecConfig):
                value = value.to_dict()
            elif isinstance(value, ErrorFeedbackConfig):
                value = {k: getattr(value, k) for k in ("beta", "reset_interval", "storage", "storage_block_size")}
            out[f.name] = value
        if self.auto is None:  # written only when set: configs recorded before auto existed stay equal
            del out["auto"]
        if not self.error_probe_interval:  # a diagnostic: written only when on, so recorded configs stay equal
            del out["error_probe_interval"]
        if not self.pp_activation_delta:  # written only when on: configs recorded before AQ-SGD stay equal
            del out["pp_activation_delta"]
            if self.pp_activation_delta_warmup_visits == 1:
                del out["pp_activation_delta_warmup_visits"]
        for name in ("pp_activation_delta_warmup_full_gradients", "pp_activation_delta_bits"):
            if not getattr(self, name):  # written only when on: configs recorded before them stay equal
                del out[name]
        return out


@dataclass
class Channels:
    """The channels of one run, one per traffic path (see CommCompressionConfig's field docs for what each
    path carries). Built by :meth:`CommCompressionConfig.build_channels`; the layers, the pipeline
    communicator and the sharded optimizer each take theirs from here."""

    tp_forward: Channel
    """Forward TP all-reduce / all-gather."""
    tp_backward: Channel
    """Backward TP collectives (one error-feedback key per layer)."""
    sp_all_gather: Channel
    """Forward sequence-parallel all-gather."""
    sp_reduce_scatter: Channel
    """Forward sequence-parallel reduce-scatter."""
    pp_activation: Channel
    """Activations sent to the next pipeline stage."""
    pp_gradient: Channel
    """Activation gradients sent to the previous stage (error feedback per boundary and micro-batch slot)."""
    dp_gradient: Channel
    """Data-parallel gradient reduce-scatter (error feedback per bucket); a LowRankChannel for PowerSGD."""
    dp_parameter: Channel
    """Data-parallel parameter all-gather."""

    def items(self):
        """(path, channel) pairs in TRAFFIC_PATHS order."""
        return [(p, getattr(self, p)) for p in TRAFFIC_PATHS]

    def set_validate(self, enabled: bool) -> None:
        """Turn argument validation of every channel on or off (the trainer turns it off after the first
        iteration, when shapes are known to agree)."""
        for _, ch in self.items():
            ch.set_validate(enabled)

    def attach_probe(self, probe) -> None:
        """Give every channel the same ``ErrorProbe`` (megacomp.comm.probe); None detaches it."""
        for _, ch in self.items():
            ch.probe = probe

    def state_dict(self, skip_error_feedback: tuple = ()) -> dict[str, Any]:
        """Every channel's state (error feedback and stochastic stream), by path; the error feedback of the
        paths in ``skip_error_feedback`` is left to its owner (the trainer's optimizer saves dp_gradient's)."""
        return {p: ch.state_dict(error_feedback=p not in skip_error_feedback) for p, ch in self.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ValueError naming a path whose codec or error feedback differs."""
        for p, ch in self.items():
            ch.load_state_dict(state[p])


@dataclass
class ModelParallelConfig:
    """Parallel layout and numerics shared by the parallel layers (mirrors Megatron-core's config)."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each layer's weights."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages."""
    sequence_parallel: bool = False
    """Split activations outside the tensor-parallel regions along the sequence (first) dimension;
    replaces the TP all-reduces with all-gather + reduce-scatter."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of the layers' parameters."""
    compression: CommCompressionConfig = field(default_factory=CommCompressionConfig)
    """Codec per traffic path."""
    channels: Optional[Channels] = None
    """The channels the layers use; None builds them from ``compression`` (and ``process_groups``) once, here."""
    process_groups: Optional[Any] = None
    """A megacomp.parallel_state.ProcessGroups to use; None = the parallel_state façade's default."""
    perform_initialization: bool = True
    """Initialise weights with init_method (False leaves them uninitialised, e.g. before loading)."""

    def __post_init__(self) -> None:
        if isinstance(self.params_dtype, str):
            if self.params_dtype not in _DTYPES:
                raise ValueError(f"params_dtype {self.params_dtype!r} is not one of {sorted(_DTYPES)}")
            self.params_dtype = _DTYPES[self.params_dtype]
        if isinstance(self.compression, Mapping):
            self.compression = CommCompressionConfig.from_dict(self.compression)
        if self.tensor_model_parallel_size < 1 or self.pipeline_model_parallel_size < 1:
            raise ValueError("tensor_model_parallel_size and pipeline_model_parallel_size must be >= 1")
        if self.channels is None:
            self.channels = self.compression.build_channels(self.process_groups)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelParallelConfig":
        """Build from a mapping; raises ValueError naming unknown keys."""
        data = dict(data)
        _check_keys(cls, data)
        return cls(**data)

    def tp_group(self, tp_group=None):
        """The TP group a layer uses: the explicit one, else this config's groups, else the façade's.
        Raises if its size differs from ``tensor_model_parallel_size``."""
        if tp_group is None:
            if self.process_groups is not None:
                tp_group = self.process_groups.tp
            else:
                from . import parallel_state

                tp_group = parallel_state.get_tensor_model_parallel_group()
        import torch.distributed as dist

        size = dist.get_world_size(tp_group)
        if size != self.tensor_model_parallel_size:
            raise ValueError(f"the tensor-parallel group has {size} ranks but config.tensor_model_parallel_size is "
                             f"{self.tensor_model_parallel_size}; make them agree")
        return tp_group


def _ef_codec(value):
    """The codec error feedback is checked against: a per-hop setting's slowest lossy codec (identity if none)."""
    if isinstance(value, HopCodecs):
        lossy = [c for _, c in value.codecs if not c.is_identity]
        return lossy[-1] if lossy else make_codec(None)
    return value


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML file into a dict (empty file -> {})."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
