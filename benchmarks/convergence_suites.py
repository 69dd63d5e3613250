"""The variants of benchmarks/convergence.py, per suite: each is a compression preset (a mapping of
CommCompressionConfig fields) with optional keys ``args`` (more pretrain flags; "@f" = that fraction of the
run's iterations), ``baseline`` (the variant it is compared with), ``hook`` (a torch-DDP run through
benchmarks/ddp_convergence.py), ``freeze`` / ``warmup`` (fractions of the run). Data only; the suites are described
in benchmarks/convergence.py's docstring."""
from __future__ import annotations

from typing import Optional

INT4 = {"name": "int4", "block_size": 128}
INT2 = {"name": "int2", "block_size": 128}
INT4_TENSOR = {"name": "int4", "block_size": 0}
SUITES = {
    "dp": {"layout": [], "variants": {
        "none": {},
        "int4+LoCo": {"dp_gradient": INT4, "dp_gradient_error_feedback": "loco"},
        "int4 (no EF)": {"dp_gradient": INT4},
        "int2 (no EF)": {"dp_gradient": INT2},
        "int2+LoCo": {"dp_gradient": INT2, "dp_gradient_error_feedback": "loco"},
        "int4+LoCo, int8 params": {"dp_gradient": INT4, "dp_gradient_error_feedback": "loco",
                                   "dp_parameter": {"name": "int8", "block_size": 256}},
        # one scale per bucket shard (the coarse regime of LoCo's fixed global scale): where EF matters
        "int4/tensor (no EF)": {"dp_gradient": INT4_TENSOR},
        "int4/tensor+LoCo": {"dp_gradient": INT4_TENSOR, "dp_gradient_error_feedback": "loco"},
        "int4/tensor+EF": {"dp_gradient": INT4_TENSOR, "dp_gradient_error_feedback": "ef"},
        "int2+EF": {"dp_gradient": INT2, "dp_gradient_error_feedback": "ef"},
    }},
    # longer runs of the coarse (one scale per shard) int4 regime, where error feedback has work to do
    "ef": {"layout": [], "variants": {
        "none": {},
        "int4/tensor (no EF)": {"dp_gradient": INT4_TENSOR},
        "int4/tensor+EF": {"dp_gradient": INT4_TENSOR, "dp_gradient_error_feedback": "ef"},
        "int4/tensor+LoCo": {"dp_gradient": INT4_TENSOR, "dp_gradient_error_feedback": "loco"},
    }},
    # 1-bit Adam's remedy for Adam x error feedback: full-precision warm-up (first 20% of the iterations),
    # then Adam's second moment frozen ("freeze": fraction of --iters) while the codec runs
    "frozen": {"layout": [], "variants": {
        "none": {},
        "none, frozen v": {"freeze": 0.2},
        "int4/tensor (no EF), frozen v": {"dp_gradient": INT4_TENSOR, "freeze": 0.2},
        "int4/tensor+EF, frozen v": {"dp_gradient": INT4_TENSOR, "dp_gradient_error_feedback": "ef", "freeze": 0.2},
        "int4/tensor+LoCo, frozen v": {"dp_gradient": INT4_TENSOR, "dp_gradient_error_feedback": "loco", "freeze": 0.2},
        "int4/tensor+EF, warm-up only": {"dp_gradient": INT4_TENSOR, "dp_gradient_error_feedback": "ef",
                                         "warmup": 0.2},
        "int2 (no EF), frozen v": {"dp_gradient": INT2, "freeze": 0.2},
        "int2+EF, frozen v": {"dp_gradient": INT2, "dp_gradient_error_feedback": "ef", "freeze": 0.2},
        "int2+LoCo, frozen v": {"dp_gradient": INT2, "dp_gradient_error_feedback": "loco", "freeze": 0.2},
    }},
    # AQ-SGD, fine-tuning style (256 samples seen for many epochs), gradients uncompressed throughout
    "aqsgd": {"layout": ["--pipeline-model-parallel-size", "2", "--dataset-samples", "256"],
              "bytes_kinds": ["pp_activation"], "variants": {
        "none": {},
        "AQ-SGD int4 delta": {"pp_activation": INT4, "pp_activation_delta": True},
        "AQ-SGD int2 delta": {"pp_activation": INT2, "pp_activation_delta": True},
        "direct int4": {"pp_activation": INT4},
        "direct int2": {"pp_activation": INT2},
    }},
    # AQ-SGD fine-tuning proper: from a checkpoint pretrained on the whole corpus (built once by "prepare"),
    # 20 epochs over 256 samples at a tenth of the pretraining learning rate; the same variants
    "aqsgd_finetune": {"layout": ["--pipeline-model-parallel-size", "2", "--dataset-samples", "256", "--load",
                                  "results/aqsgd_pretrained", "--finetune", "--lr", "3e-4", "--min-lr", "3e-5"],
                       "prepare": {"dir": "results/aqsgd_pretrained", "nproc": 2, "args": [
                           "--pipeline-model-parallel-size", "2", "--train-iters", "600", "--save",
                           "results/aqsgd_pretrained", "--seed", "1234"]},
                       "bytes_kinds": ["pp_activation"], "variants": {
        "none": {},
        "AQ-SGD int4 delta": {"pp_activation": INT4, "pp_activation_delta": True},
        "AQ-SGD int2 delta": {"pp_activation": INT2, "pp_activation_delta": True},
        "direct int4": {"pp_activation": INT4},
        "direct int2": {"pp_activation": INT2},
    }},
    # one seed: what makes 2-bit deltas work (block size, rounding, a longer uncompressed warm-up)
    "aqsgd_sweep": {"layout": ["--pipeline-model-parallel-size", "2", "--dataset-samples", "256"],
                    "bytes_kinds": ["pp_activation"], "variants": {
        "none": {},
        "AQ-SGD int2 delta": {"pp_activation": INT2, "pp_activation_delta": True},
        "AQ-SGD int2/b32 delta": {"pp_activation": {**INT2, "block_size": 32}, "pp_activation_delta": True},
        "AQ-SGD int2/b16 delta": {"pp_activation": {**INT2, "block_size": 16}, "pp_activation_delta": True},
        "AQ-SGD int2/sr delta": {"pp_activation": {**INT2, "rounding": "stochastic"}, "pp_activation_delta": True},
        "AQ-SGD int2 delta, 4 warm-up visits": {"pp_activation": INT2, "pp_activation_delta": True,
                                                "pp_activation_delta_warmup_visits": 4},
        "AQ-SGD int4/b32 delta": {"pp_activation": {**INT4, "block_size": 32}, "pp_activation_delta": True},
        "direct int2/b16": {"pp_activation": {**INT2, "block_size": 16}},
    }},
    "pp": {"layout": ["--pipeline-model-parallel-size", "2"], "variants": {
        "none": {},
        "int8 act + int8/EF grad": {"pp_activation": {"name": "int8", "block_size": 128},
                                    "pp_gradient": {"name": "int8", "block_size": 128},
                                    "pp_gradient_error_feedback": "ef"},
    }},
}


FROZEN = {"freeze": 0.2}
# the error-feedback acceptance set, meant to be run over several seeds (--seeds 1,2,3): int4+LoCo against fp32 and
# against int4/int2 without error feedback, per block and with one scale per shard, under AdamW (a subset
# of "dp") and under AdamW with 1-bit Adam's warm-up and frozen second moment (compared with "none, frozen v")
SUITES["zero"] = {"layout": [], "variants": {
    **{name: SUITES["dp"]["variants"][name] for name in (
        "none", "int4+LoCo", "int4 (no EF)", "int2 (no EF)", "int2+LoCo", "int4+LoCo, int8 params",
        "int4/tensor (no EF)", "int4/tensor+LoCo")},
    "none, frozen v": FROZEN,
    "int4+LoCo, frozen v": {"dp_gradient": INT4, "dp_gradient_error_feedback": "loco", **FROZEN},
    "int4 (no EF), frozen v": {"dp_gradient": INT4, **FROZEN},
    "int2+LoCo, frozen v": {"dp_gradient": INT2, "dp_gradient_error_feedback": "loco", **FROZEN},
    "int2 (no EF), frozen v": {"dp_gradient": INT2, **FROZEN},
    "int4/tensor+LoCo, frozen v": {"dp_gradient": INT4_TENSOR, "dp_gradient_error_feedback": "loco", **FROZEN},
    "int4/tensor (no EF), frozen v": {"dp_gradient": INT4_TENSOR, **FROZEN},
}}


# DiLoCo over 4 replicas of one DP rank each (the same tokens per iteration as 4-rank DDP):
# outer exchange every H = 50 steps, uncompressed or int4 + classic EF, against DDP-AdamW ("none")
DILOCO = ["--outer-algorithm", "diloco", "--num-replicas", "4", "--outer-steps", "50"]
SUITES["diloco"] = {"layout": [], "variants": {
    "none": {},
    "DiLoCo H=50": {"args": DILOCO},
    "DiLoCo H=50, int4+EF outer": {"args": [*DILOCO, "--outer-codec", "int4", "--outer-error-feedback", "ef"]},
    "DiLoCo H=10": {"args": [*DILOCO[:-1], "10"]},
    "Streaming DiLoCo H=50 P=4 tau=5, int4+EF outer": {"args": [
        "--outer-algorithm", "streaming_diloco", "--num-replicas", "4", "--outer-steps", "50", "--outer-fragments", "4",
        "--outer-delay", "5", "--outer-codec", "int4", "--outer-error-feedback", "ef"]},
    "NoLoCo H=50 (groups of 2)": {"args": ["--outer-algorithm", "noloco", "--num-replicas", "4", "--outer-steps", "50"]},
    "MT-DAO H=50 (slow 0.999, w 0.9)": {"args": ["--outer-algorithm", "mt_dao", "--num-replicas", "4", "--outer-steps", "50"]},
    "MT-DAO H=50 (slow 0.99, w 0.5)": {"args": ["--outer-algorithm", "mt_dao", "--num-replicas", "4", "--outer-steps", "50",
                                                "--mt-dao-slow-betas", "0.99", "--mt-dao-slow-weights", "0.5"]},
}}
# What closes DiLoCo's gap to DDP at this scale: outer lr, inner lr, H (a sweep; one seed is enough to rank)
SUITES["diloco_sweep"] = {"layout": [], "variants": {
    "none": {},
    "DiLoCo H=50": {"args": DILOCO},
    "DiLoCo H=50, outer lr 1.0": {"args": [*DILOCO, "--outer-lr", "1.0"]},
    "DiLoCo H=50, outer lr 1.4": {"args": [*DILOCO, "--outer-lr", "1.4"]},
    "DiLoCo H=50, inner lr x2": {"args": [*DILOCO, "--lr", "6e-3", "--min-lr", "6e-4"]},
    "DiLoCo H=50, outer lr 1.0, inner lr x2": {"args": [*DILOCO, "--outer-lr", "1.0", "--lr", "6e-3", "--min-lr", "6e-4"]},
    "DiLoCo H=50, outer lr 0.4": {"args": [*DILOCO, "--outer-lr", "0.4"]},
    "DiLoCo H=50, outer lr 0.7, momentum 0.6": {"args": [*DILOCO, "--outer-momentum", "0.6"]},
    "DiLoCo H=50, outer lr 0.7, momentum 0.3": {"args": [*DILOCO, "--outer-momentum", "0.3"]},
    "DiLoCo H=5": {"args": [*DILOCO[:-1], "5"]},
    "DDP, inner lr x2": {"args": ["--lr", "6e-3", "--min-lr", "6e-4"]},
}}
# Where the gap comes from (one seed ranks): four replicas that never synchronise (H beyond the run), plain parameter
# averaging (outer lr 1, no momentum) every 50, 5 and 1 steps, the effective learning rate (DDP at half the lr;
# averaging every step at twice the inner lr), and DiLoCo H=50 with 4x the per-replica batch and with 2x the width,
# each against DDP at the same batch or width.
AVERAGING = ["--outer-algorithm", "diloco", "--num-replicas", "4", "--outer-lr", "1", "--outer-momentum", "0",
             "--outer-steps"]
BATCH64 = ["--micro-batch-size", "16", "--global-batch-size", "64"]
WIDTH128 = ["--hidden-size", "128"]
SUITES["diloco_regime"] = {"layout": [], "variants": {
    "none": {},
    "DiLoCo H=50": {"args": DILOCO},
    "no synchronisation": {"args": [*AVERAGING, "1000000"]},
    "averaging H=1": {"args": [*AVERAGING, "1"]},
    "averaging H=5": {"args": [*AVERAGING, "5"]},
    "averaging H=50": {"args": [*AVERAGING, "50"]},
    "averaging H=1, inner lr x2": {"args": [*AVERAGING, "1", "--lr", "6e-3", "--min-lr", "6e-4"]},
    "DDP, lr /2": {"args": ["--lr", "1.5e-3", "--min-lr", "1.5e-4"]},
    "none, batch 64": {"args": BATCH64},
    "DiLoCo H=50, batch 64": {"args": [*DILOCO, *BATCH64], "baseline": "none, batch 64"},
    "none, hidden 128": {"args": WIDTH128},
    "DiLoCo H=50, hidden 128": {"args": [*DILOCO, *WIDTH128], "baseline": "none, hidden 128"},
}}

# DeMo (no gradient all-reduce; each DP rank all-gathers its top-k DCT momentum components) against
# DDP-AdamW on 4 DP ranks; DeMo's --lr is its sign-SGD step. The sweep ranks learning rates and decays on one seed.
def demo(lr: float, *more: str, values: Optional[str] = None) -> dict:
    """A DeMo variant: peak lr (min lr a tenth of it), further flags, and the format of the kept values."""
    out = {"args": ["--optimizer", "demo", "--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}", *more]}
    if values:
        out["dp_gradient"] = values
    return out


SUITES["demo_sweep"] = {"layout": [], "variants": {
    "none": {},
    "DeMo lr 1e-3": demo(1e-3),
    "DeMo lr 3e-3": demo(3e-3),
    "DeMo lr 6e-3": demo(6e-3),
    "DeMo lr 3e-3, decay 0.99": demo(3e-3, "--demo-decay", "0.99"),
    "DeMo lr 3e-3, decay 0.9": demo(3e-3, "--demo-decay", "0.9"),
    "DeMo lr 1.2e-2": demo(1.2e-2),
}}

# SparseLoCo (top-k per chunk, 2-bit values, an error-feedback accumulator in place of outer momentum)
# and DCT-momentum DiLoCo (the same rule with a chunked-DCT top-k codec) against DiLoCo at equal tokens
SPARSELOCO = ["--outer-algorithm", "sparseloco", "--num-replicas", "4", "--outer-steps", "50"]
DCT_CODEC = '{name: bf16, transform: dct, chunk: 64, k: 4}'
# and DeMo at the sweep's best learning rate, the reference's fp32 values (top-32 of 64 x 64), bf16 top-16 and top-24
SUITES["structured"] = {"layout": [], "variants": {
    "none": {},
    "DiLoCo H=50": {"args": DILOCO},
    "SparseLoCo H=50 (int2, top-64/4096)": {"args": SPARSELOCO},
    "DCT-DiLoCo H=50 (bf16, DCT top-4/64)": {"args": [*SPARSELOCO, "--outer-codec", DCT_CODEC]},
    "DeMo lr 6e-3 (fp32, top-32)": demo(6e-3),
    "DeMo lr 6e-3 (bf16, top-16)": demo(6e-3, "--demo-topk", "16", values="bf16"),
    # bf16 top-24 of 4096: 96 bytes per chunk and rank instead of 64, about 53x fewer DP bytes than DDP-AdamW
    "DeMo lr 6e-3 (bf16, top-24)": demo(6e-3, "--demo-topk", "24", values="bf16"),
}}


# PowerSGD inside torch DDP, megacomp's hook (any number of buckets, error feedback with each rank's own
# approximation, QR) side by side with torch's (one bucket: it races on gloo with more), ranks 4 and 1; Accordion
# switching rank 4 (critical regimes) and rank 1; and megacomp's PowerSGD rank 4 on the sharded optimizer in
# pretraining. Run by benchmarks/ddp_convergence.py (same model, data, schedule and AdamW as megacomp.pretrain).
ACCORDION = ("{name: accordion, low: {name: powersgd, rank: 4}, high: {name: powersgd, rank: 1}, eta: 0.5, "
             "interval: 15}")
SUITES["powersgd"] = {"layout": [], "variants": {
    "none": {"hook": "none"},
    "torch PowerSGD r4 (1 bucket)": {"hook": "torch_powersgd:4"},
    "megacomp PowerSGD r4+EF": {"hook": "megacomp:{name: powersgd, rank: 4}"},
    "torch PowerSGD r1 (1 bucket)": {"hook": "torch_powersgd:1"},
    "megacomp PowerSGD r1+EF": {"hook": "megacomp:{name: powersgd, rank: 1}"},
    "Accordion r4/r1 (eta 0.5, every 15)": {"hook": "megacomp:" + ACCORDION},
    # the reference's pair (rank 2 in critical regimes, rank 1 otherwise) and its static low
    "megacomp PowerSGD r2+EF": {"hook": "megacomp:{name: powersgd, rank: 2}"},
    "Accordion r2/r1 (eta 0.5, every 15)": {"hook": "megacomp:" + ACCORDION.replace("rank: 4", "rank: 2")},
    "megacomp PowerSGD r4, sharded optimizer": {"dp_gradient": {"name": "powersgd", "rank": 4}},
}}

# Accordion's threshold and interval on one seed (with eta 0.5 every 15 steps it leaves rank 4 after 30 steps)
def accordion(eta: float, interval: int) -> dict:
    """An Accordion hook variant over PowerSGD ranks 4 (critical) / 1."""
    return {"hook": "megacomp:" + ACCORDION.replace("eta: 0.5", f"eta: {eta:g}").replace("interval: 15",
                                                                                        f"interval: {interval}")}


SUITES["accordion_sweep"] = {"layout": [], "variants": {
    "none": {"hook": "none"},
    "megacomp PowerSGD r4+EF": SUITES["powersgd"]["variants"]["megacomp PowerSGD r4+EF"],
    "megacomp PowerSGD r1+EF": SUITES["powersgd"]["variants"]["megacomp PowerSGD r1+EF"],
    "Accordion eta 0.2, every 15": accordion(0.2, 15),
    "Accordion eta 0.1, every 15": accordion(0.1, 15),
    "Accordion eta 0.2, every 5": accordion(0.2, 5),
    "Accordion eta 0.05, every 30": accordion(0.05, 30),
    # the reference's granularity and pair: a decision per layer (DDP buckets of 0.25 MB, about one transformer
    # layer of this model each, instead of one bucket for the model) and PowerSGD rank 2 (critical) / rank 1
    "megacomp PowerSGD r2+EF": SUITES["powersgd"]["variants"]["megacomp PowerSGD r2+EF"],
    "Accordion r4/r1, per layer": {**accordion(0.5, 15), "args": ["--bucket-mb", "0.25"]},
    "Accordion r2/r1": SUITES["powersgd"]["variants"]["Accordion r2/r1 (eta 0.5, every 15)"],
    "Accordion r2/r1, per layer": {**SUITES["powersgd"]["variants"]["Accordion r2/r1 (eta 0.5, every 15)"],
                                   "args": ["--bucket-mb", "0.25"]},
}}


# PyTorch FSDP2 (fully_shard on every transformer layer and the model) with megacomp's codecs as its
# custom reduce-scatter / all-gather (megacomp.integrations.fsdp), against stock FSDP2 ("none"). The "off" row
# runs megacomp's collectives with identity codecs: bit-identical to stock (its loss must equal it), and it counts
# the uncompressed bytes stock FSDP2 sends. Run by benchmarks/ddp_convergence.py.
FSDP_LOSSY = "dp_gradient: {name: int4}, dp_gradient_error_feedback: loco, min_compress_numel: 4096"
SUITES["fsdp"] = {"layout": [], "bytes_reference": "megacomp FSDP2, compression off", "variants": {
    "none": {"hook": "fsdp2:none"},
    "megacomp FSDP2, compression off": {"hook": "fsdp2:{}"},
    "LoCo int4 gradients": {"hook": "fsdp2:{" + FSDP_LOSSY + "}"},
    "LoCo int4 gradients + int8 parameters": {"hook": "fsdp2:{" + FSDP_LOSSY + ", dp_parameter: int8}"},
}}


# the 1-bit family on DP 4, each against its own uncompressed optimizer (the `baseline` key): 1-bit
# Adam and 0/1 Adam against AdamW, 1-bit LAMB against LAMB (1-bit LAMB with the freeze never reached and the
# momentum uncompressed). Warm-up / variance freeze at 20% of the run (the paper's 15-25%); 0/1 Adam's
# intervals scaled to the run length (DeepSpeed's example: var_freeze 1000, scalers 16 and 1000, clipper 16).
# Unsharded (--no-shard-optimizer), so the DP bytes are the momentum's; one sharded 1-bit Adam row shows the
# fp32 parameter all-gather that sharding adds.
# LAMB's step is relative to each layer's weight norm. Sweep at 150 iterations (seed 1234): lr 3e-3, 1e-2, 3e-2
# gave final losses 6.37, 5.23, 4.21 (AdamW at its 3e-3: 4.73); but at 3e-2 1-bit LAMB diverged on seed 3 after
# the switch (loss 25.6 at iteration 198), also with its momentum uncompressed (iteration 184): the frozen trust
# ratio times DeepSpeed's factor (the max over elements of frozen / fresh denominators, up to factor_max = 4)
# outgrows LAMB's own ratio. So the suite runs LAMB at 1e-2.
LAMB_LR = ("--lr", "1e-2")
OFF = ("--momentum-codec", "none", "--no-momentum-error-feedback")


def onebit(optimizer: str, *more: str, baseline: str = "none") -> dict:
    """A 1-bit-family variant: the pretrain flags and the variant it is compared with."""
    return {"args": ["--optimizer", optimizer, *more], "baseline": baseline}


SUITES["onebit"] = {"layout": [], "variants": {
    "none": {},
    "1-bit Adam (freeze 20%)": onebit("onebit_adam", "--freeze-step", "@0.2", "--no-shard-optimizer"),
    "1-bit Adam, sharded": onebit("onebit_adam", "--freeze-step", "@0.2", "--shard-optimizer"),
    "1-bit Adam, compression off (frozen v only)": onebit("onebit_adam", "--freeze-step", "@0.2", *OFF,
                                                          "--no-shard-optimizer"),
    "0/1 Adam (var freeze 20%)": onebit("zero_one_adam", "--var-freeze-step", "@0.2", "--var-update-scaler", "16",
                                        "--local-step-scaler", "@0.1", "--local-step-clipper", "16",
                                        "--no-shard-optimizer"),
    "0/1 Adam, clipper 4 (from onebit_sweep)": onebit(
        "zero_one_adam", "--var-freeze-step", "@0.2", "--var-update-scaler", "16", "--local-step-scaler", "@0.1",
        "--local-step-clipper", "4", "--no-shard-optimizer"),
    # the variance refreshed every step until its freeze (DeepSpeed's var_update_scaler: after that many refreshes
    # the interval doubles; 16 refreshes the variance at 49 of the first 120 steps of a 600-step run, 128 at all 120)
    "0/1 Adam, clipper 4, var scaler 128": onebit(
        "zero_one_adam", "--var-freeze-step", "@0.2", "--var-update-scaler", "128", "--local-step-scaler", "@0.1",
        "--local-step-clipper", "4", "--no-shard-optimizer"),
    "LAMB (lr 1e-2)": onebit("onebit_lamb", "--freeze-step", "100000000", *OFF, "--no-shard-optimizer", *LAMB_LR),
    "1-bit LAMB (freeze 20%, lr 1e-2)": onebit("onebit_lamb", "--freeze-step", "@0.2", "--no-shard-optimizer",
                                               *LAMB_LR, baseline="LAMB (lr 1e-2)"),
    "1-bit LAMB, factor_max 2 (from onebit_sweep)": onebit(
        "onebit_lamb", "--freeze-step", "@0.2", "--factor-max", "2", "--no-shard-optimizer", *LAMB_LR,
        baseline="LAMB (lr 1e-2)"),
    "1-bit LAMB, compression off (lr 1e-2)": onebit("onebit_lamb", "--freeze-step", "@0.2", *OFF,
                                                    "--no-shard-optimizer", *LAMB_LR, baseline="LAMB (lr 1e-2)"),
}}


# One seed of what could close 0/1 Adam's and 1-bit LAMB's gaps: shorter local-step intervals (clipper 4, 8),
# and 1-bit LAMB with a smaller factor_max or a later freeze
SUITES["onebit_sweep"] = {"layout": [], "variants": {
    "none": {},
    "0/1 Adam, clipper 8": onebit("zero_one_adam", "--var-freeze-step", "@0.2", "--local-step-scaler", "@0.1",
                                  "--local-step-clipper", "8", "--no-shard-optimizer"),
    "0/1 Adam, clipper 4": onebit("zero_one_adam", "--var-freeze-step", "@0.2", "--local-step-scaler", "@0.1",
                                  "--local-step-clipper", "4", "--no-shard-optimizer"),
    "LAMB (lr 1e-2)": SUITES["onebit"]["variants"]["LAMB (lr 1e-2)"],
    "1-bit LAMB, factor_max 2": onebit("onebit_lamb", "--freeze-step", "@0.2", "--factor-max", "2",
                                       "--no-shard-optimizer", *LAMB_LR, baseline="LAMB (lr 1e-2)"),
    "1-bit LAMB, freeze 40%": onebit("onebit_lamb", "--freeze-step", "@0.4", "--no-shard-optimizer", *LAMB_LR,
                                     baseline="LAMB (lr 1e-2)"),
}}


def fused(optimizer: str, lr: str, *more: str, baseline: str = "none", **compression) -> dict:
    """A LOMO / AdaLomo variant: one micro-batch per DP rank, the tiny config's 16 = 4 x 4 ranks."""
    return {**compression, "args": ["--optimizer", optimizer, "--lr", lr, *more], "baseline": baseline}


# One seed of learning rates: AdaLomo's step is relative to each parameter's RMS (about 0.02 for the matrices at
# initialisation); the paper's AdaLomo has no clipping by the global norm (its grouped update normalisation
# replaces it, and saves LOMO's second backward pass): --clip-grad 0, one run with LOMO's clipping for comparison
SUITES["lomo_sweep"] = {"layout": [], "variants": {
    "none": {},
    "AdaLomo lr 0.03, clip 1": fused("adalomo", "0.03"),
    **{f"AdaLomo lr {lr}": fused("adalomo", lr, "--clip-grad", "0") for lr in ("0.03", "0.1", "0.3")},
}}
ADALOMO = ("0.1", "--clip-grad", "0")  # the sweep's best (benchmarks/results/convergence_lomo_sweep)
SUITES["lomo"] = {"layout": [], "variants": {
    "none": {},
    "AdaLomo (lr 0.1)": fused("adalomo", *ADALOMO),
    "AdaLomo, int4+LoCo gradients": fused("adalomo", *ADALOMO, baseline="AdaLomo (lr 0.1)", dp_gradient=INT4,
                                          dp_gradient_error_feedback="loco"),
    "AdamW (lr 1e-2)": {"args": ["--lr", "0.01"]},  # AdamW at the LoQT runs' lr 1e-2 (worse than at 3e-3)
    # LoQT on AdamW: rank 16 of hidden 64 (the reference's 350M: 256 of 1024), merges at 0, 50, 101, 152, 203
    **{f"LoQT r16, {q} base{', lr 1e-2' if lr else ''}": {
        "args": ["--loqt-rank", "16", "--loqt-codec", f"{{name: {q}, block_size: 32}}", "--loqt-update-interval", "50",
                 *(["--lr", lr] if lr else [])], "baseline": "none"}
       for q, lr in (("int8", ""), ("int8", "0.01"), ("int4", "0.01"))},
}}


# every traffic path alone and all together, with the `all` preset's setting for each path (TP and SP
# in fp8 e4m3 + Hadamard 128, DP gradients int4 + LoCo, DP parameters int8/256), TP 2 x DP 2 with sequence
# parallelism; bytes counted over every iteration for every kind it uses
FP8H = {"name": "fp8_e4m3", "block_size": 128, "hadamard": 128}
ALL_PATHS = {"tp_forward": {"tp_forward": FP8H}, "tp_backward": {"tp_backward": FP8H},
             "sp_all_gather": {"sp_all_gather": FP8H}, "sp_reduce_scatter": {"sp_reduce_scatter": FP8H},
             "dp_gradient int4+LoCo": {"dp_gradient": INT4, "dp_gradient_error_feedback": "loco"},
             "dp_parameter int8": {"dp_parameter": {"name": "int8", "block_size": 256}}}
SUITES["ablation_tp2dp2"] = {
    "layout": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "bytes_kinds": ["tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter", "dp_gradient", "dp_parameter"],
    "variants": {"none": {}, **{f"{name} alone": comp for name, comp in ALL_PATHS.items()},
                 "all": {k: v for comp in ALL_PATHS.values() for k, v in comp.items()}}}


# the near-lossless preset (configs/compression/all_int8.yaml: int8 everywhere, TP/SP after a
# Hadamard-128 rotation), path by path and all together, on TP 2 x DP 2 (added to ablation_tp2dp2) and TP 2 x PP 2;
# every run probes its compression error every 50 iterations (megacomp.comm.probe; never changes the numbers)
INT8H = {"name": "int8", "block_size": 128, "hadamard": 128}
PROBE = {"error_probe_interval": 50}
INT8_PATHS = {"tp_backward int8h": {"tp_backward": INT8H}, "sp_all_gather int8h": {"sp_all_gather": INT8H},
              "sp_reduce_scatter int8h": {"sp_reduce_scatter": INT8H},
              "dp_gradient int8": {"dp_gradient": {"name": "int8", "block_size": 128}},
              "dp_parameter int8": {"dp_parameter": {"name": "int8", "block_size": 256}},
              "pp_activation int8": {"pp_activation": {"name": "int8", "block_size": 128}},
              "pp_gradient int8+EF": {"pp_gradient": {"name": "int8", "block_size": 128},
                                      "pp_gradient_error_feedback": "ef"}}
ALL_INT8 = {k: v for comp in INT8_PATHS.values() for k, v in comp.items()}
ALL_INT8["tp_forward"] = INT8H
ALL_FP8 = {k: v for comp in ALL_PATHS.values() for k, v in comp.items()}
SUITES["ablation_tp2dp2"]["variants"].update({
    **{f"{name} alone": {**INT8_PATHS[name], **PROBE}
       for name in ("tp_backward int8h", "sp_all_gather int8h", "sp_reduce_scatter int8h", "dp_gradient int8")},
    "all_int8": {**ALL_INT8, **PROBE},
    # a control: 16-bit casts on the same paths (relative error ~0.2-0.4%, what nobody calls lossy for training),
    # to tell the gap compression costs from the gap any perturbation of the uncompressed trajectory shows
    "all bf16 (control)": {**{p: "bf16" for p in ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter",
                                                  "dp_gradient", "dp_parameter")}, **PROBE}})
SUITES["ablation_tp2pp2"] = {
    "layout": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"],
    "bytes_kinds": ["tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter", "pp_activation", "pp_gradient"],
    "variants": {"none": {},
                 **{f"{name} alone": {**INT8_PATHS[name], **PROBE}
                    for name in ("tp_backward int8h", "sp_all_gather int8h", "sp_reduce_scatter int8h",
                                 "pp_activation int8", "pp_gradient int8+EF")},
                 "all (fp8 TP)": {**ALL_FP8, "pp_activation": {"name": "int8", "block_size": 128},
                                  "pp_gradient": {"name": "int8", "block_size": 128}, "pp_gradient_error_feedback": "ef",
                                  **PROBE},
                 "all_int8": {**ALL_INT8, **PROBE}}}


# the codec options on TP/SP traffic, measured with the error probe during training (short runs: the
# table of interest is the probe's, not the loss): TP 2 x DP 2 with sequence parallelism, the option on
# tp_backward, sp_all_gather and sp_reduce_scatter, probed every 20 iterations. Block 64 = one row of the tiny
# GPT's hidden dimension (64): blocks that follow the hidden dimension instead of spanning two tokens.
def _tp(codec: dict) -> dict:
    return {**{p: codec for p in ("tp_backward", "sp_all_gather", "sp_reduce_scatter")}, "error_probe_interval": 20}


SUITES["tp_codecs"] = {
    "layout": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "bytes_kinds": ["tp_backward", "sp_all_gather", "sp_reduce_scatter"],
    "variants": {"none": {},
                 "fp8 e4m3 /128, Hadamard 128 (all)": _tp(FP8H),
                 "fp8 e4m3 /128, Hadamard 128, dual scale": _tp({**FP8H, "dual_scale": True}),
                 "int8 /128, no Hadamard": _tp({"name": "int8", "block_size": 128}),
                 "int8 /128, Hadamard 128 (all_int8)": _tp(INT8H),
                 "int8 /128, Hadamard 128, dual scale": _tp({**INT8H, "dual_scale": True}),
                 "int8 /64 (one row), Hadamard 64": _tp({"name": "int8", "block_size": 64, "hadamard": 64}),
                 "int4 /128, Hadamard 128": _tp({"name": "int4", "block_size": 128, "hadamard": 128}),
                 # TACO's codec (megacomp.compression.taco, its defaults: reshape up to 256, adaptive
                 # Hadamard, dual-scale fp8 e4m3 /128) on the same three paths
                 "taco": _tp({"name": "taco"})}}

# the ablation's third layout, TP 2 x PP 2 x DP 2 on 8 ranks (run with --nproc 8 into its own --out: results.json
# files merge only at equal nproc; benchmarks/results/convergence_ablation_8rank ran none and all_int8)
SUITES["ablation_tp2pp2dp2"] = {
    "layout": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"],
    "bytes_kinds": ["tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter", "pp_activation", "pp_gradient",
                    "dp_gradient", "dp_parameter"],
    "variants": {"none": {}, "all (fp8 TP)": SUITES["ablation_tp2pp2"]["variants"]["all (fp8 TP)"],
                 "all_int8": {**ALL_INT8, **PROBE}}}

# ACCO (megacomp.optimizer.acco) against the sharded AdamW step it overlaps, uncompressed and with int4 +
# LoCo gradients / int8 parameters; two micro-batches of 2 per DP rank (ACCO's two halves), the same global batch
LOCO4_QWZ = {"dp_gradient": INT4, "dp_gradient_error_feedback": "loco", "dp_parameter": {"name": "int8", "block_size": 256}}
ACCO_FLAGS = ["--overlap-optimizer", "acco"]
SUITES["acco"] = {"layout": ["--micro-batch-size", "2"], "bytes_kinds": ["dp_gradient", "dp_parameter"], "variants": {
    "none": {},
    "ACCO": {"args": ACCO_FLAGS},
    "int4+LoCo, int8 params": dict(LOCO4_QWZ),
    "ACCO, int4+LoCo, int8 params": {**LOCO4_QWZ, "args": ACCO_FLAGS},
    # DPU: the same background update without halves or estimate, one step late (ZeRO-1's bytes)
    "DPU": {"args": ["--overlap-optimizer", "dpu"]},
    "DPU, int4+LoCo, int8 params": {**LOCO4_QWZ, "args": ["--overlap-optimizer", "dpu"]},
}}

# LoCoDL (megacomp.outer.locodl) next to DiLoCo and NoLoCo, 4 replicas: communication with probability p = 1/50 after
# every step (the same expected rounds as H = 50), uncompressed and with its unbiased compressors (usq4, rand-k 1/16)
LOCAL_BASELINES = {
    "none": {},
    "DiLoCo H=50": {"args": DILOCO},
    "NoLoCo H=50 (groups of 2)": {"args": ["--outer-algorithm", "noloco", "--num-replicas", "4", "--outer-steps", "50"]},
}
LOCODL = ["--outer-algorithm", "locodl", "--num-replicas", "4", "--outer-steps", "50"]
SUITES["locodl"] = {"layout": [], "variants": {
    **LOCAL_BASELINES,
    "LoCoDL p=1/50": {"args": LOCODL},
    "LoCoDL p=1/50, usq4": {"args": [*LOCODL, "--outer-codec", "usq4"]},
    "LoCoDL p=1/50, rand-k 1/16": {"args": [*LOCODL, "--outer-codec", "{name: randk, k: 256, chunk: 4096}"]},
}}
# LoDAdaC (megacomp.outer.lodadac, the paper's Algorithm 1: H local Adam-type steps, compressed gossip through tracked copies)
# next to DiLoCo and NoLoCo, 4 replicas, H = 50
LODADAC = ["--outer-algorithm", "lodadac", "--num-replicas", "4", "--outer-steps", "50"]
SUITES["lodadac"] = {"layout": [], "variants": {
    **LOCAL_BASELINES,
    "LoDAdaC H=50 ring": {"args": LODADAC},
    "LoDAdaC H=50 ring, int4": {"args": [*LODADAC, "--outer-codec", "int4"]},
    "LoDAdaC H=50 random peer, int4": {"args": [*LODADAC, "--outer-topology", "random_peer", "--outer-codec", "int4"]},
}}
