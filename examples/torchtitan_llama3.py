"""torchtitan's Llama 3 debug model, tensor parallel x FSDP2, with megacomp compressing both.

    torchrun --standalone --nproc-per-node 4 examples/torchtitan_llama3.py [--steps 4] [--tp 2]

torchtitan's own pieces build and parallelize the model: its ``llama3_debugmodel`` job config and model
(6 layers, width 256, vocabulary 2048), ``ParallelDims`` and meshes, ``parallelize_llama`` (DTensor tensor
parallelism with sequence parallelism on the ``tp`` mesh, FSDP2 on the ``fsdp`` mesh), its weight
initialisation, its chunked cross-entropy loss and its AdamW settings. Three runs from the same
initialisation on counting sequences: stock torchtitan; megacomp with compression off (must match stock bit
for bit, loss by loss); megacomp with int8 TP activations and gradients and LoCo int4 FSDP gradients
plus int8 parameter all-gathers (must train, TP bytes counted in ``megacomp.comm.stats()``).

What it changes to run on CPU (gloo), the same for all three runs, and why:
- ``torchtitan.tools.utils`` takes "cuda" as the device when no accelerator is found: the meshes are built
  for "cpu" here (``torchtitan.distributed.parallel_dims.device_type``);
- the debug model's attention is FlexAttention, whose backward torch does not implement on CPU (varlen and
  flex_flash are CUDA kernels): each layer's inner attention is torchtitan's ``ScaledDotProductAttention``
  (causal) instead;
- ``parallelism.spmd_backend = "partial_dtensor"`` (DTensor for the model-parallel axes; torchtitan 0.3.0's
  default "spmd_types" backend issues its collectives outside DTensor);
- sequence length 64 and 2 samples per rank, and the FSDP units reduce with SUM
  (``force_sum_reduction``: gloo has no PREMUL_SUM);
- torchtitan's ``Trainer`` is not used (its tokenizer and c4_test data files are test assets of its
  repository, not of the wheel): the loop below is its ``forward_backward_step`` + optimizer step.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

LOSSY = {"tp_forward": "int8", "tp_backward": "int8", "sp_all_gather": "int8", "sp_reduce_scatter": "int8",
         "dp_gradient": "int4", "dp_gradient_error_feedback": "loco", "dp_parameter": "int8",
         "min_compress_numel": 4096}
SEQ, BATCH = 64, 2


def build(tp: int, compression):
    """torchtitan's debug model on a fresh mesh, parallelized by torchtitan; with megacomp when ``compression`` is
    not None. Returns (model, loss_fn, optimizer, megacomp object or None, parallel_dims)."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as titan_dist
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from megacomp.integrations.torchtitan import TorchTitanCompression, force_sum_reduction

    titan_dims.device_type = "cpu"
    cfg = llama3_debugmodel()
    cfg.training.seq_len, cfg.training.local_batch_size = SEQ, BATCH
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.parallelism.data_parallel_shard_degree = dist.get_world_size() // tp
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.activation_checkpoint = None
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    dims.build_mesh()
    titan_dist.set_spmd_backend(cfg.parallelism.spmd_backend)
    model_cfg = cfg.model_spec.model
    for layer in model_cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model_cfg.update_from_config(config=cfg)
    with torch.device("meta"):
        model = model_cfg.build()
    model = parallelize_llama(model, parallel_dims=dims, training=cfg.training, parallelism=cfg.parallelism,
                              compile_config=cfg.compile, ac_config=None, dump_folder="/tmp")
    comp = TorchTitanCompression(compression, dims).apply(model) if compression is not None else None
    if comp is None:
        force_sum_reduction(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # torchtitan initialises on every rank; the same seed gives the same model everywhere
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    loss_fn.set_lm_head(model.lm_head)  # as torchtitan's Trainer does for its chunked loss
    model._skip_lm_head = True
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1)
    return model, loss_fn, opt, comp, dims


def train(model, loss_fn, opt, comp, dims, steps: int) -> list[float]:
    """``steps`` optimizer steps on counting sequences (each data-parallel rank its own, TP ranks the same);
    returns the global mean loss per step."""
    import contextlib

    dp_rank = dims.get_mesh("fsdp").get_local_rank() if dims.dp_shard_enabled else 0
    vocab = model.lm_head.weight.shape[0]  # the global vocabulary (a DTensor reports its global shape)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        ids = (torch.randint(0, vocab, (BATCH, 1), generator=g) + torch.arange(SEQ + 1)) % vocab  # counting
        inputs, labels = ids[:, :-1], ids[:, 1:]
        positions = torch.arange(SEQ).expand(BATCH, -1).contiguous()
        tokens = torch.tensor(float(labels.numel() * (dims.dp_shard if dims.dp_shard_enabled else 1)))
        with comp if comp is not None else contextlib.nullcontext():
            pred = model(inputs, positions=positions)
            loss, _ = loss_fn(pred, labels, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad()
        t = loss.detach().float().reshape(1)
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        if dims.dp_shard_enabled:  # each data-parallel rank holds its tokens' loss sum over the global token count
            dist.all_reduce(t, group=dims.get_mesh("fsdp").get_group())
        losses.append(t.item())
    return losses


def main() -> None:
    from megacomp import comm

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for name, compression in (("stock torchtitan", None), ("megacomp, compression off", {}),
                              ("int8 TP + LoCo int4 FSDP", LOSSY)):
        built = build(args.tp, compression)
        comm.reset_stats()
        results[name] = train(*built, args.steps)
        wire = comm.stats()
        if rank == 0:
            print(f"{name:28s} losses {' '.join(f'{x:.6f}' for x in results[name])}")
            for path, s in sorted(wire.items()):
                print(f"    {path:18s} {s.calls:5d} calls  {s.wire_bytes / 1e6:8.3f} MB on the wire "
                      f"({s.ratio:.3f} of uncompressed)")
        if compression == LOSSY:
            tp_bytes = sum(wire[p].wire_bytes for p in ("tp_forward", "tp_backward", "sp_all_gather",
                                                       "sp_reduce_scatter") if p in wire)
            tp_full = sum(wire[p].uncompressed_bytes for p in ("tp_forward", "tp_backward", "sp_all_gather",
                                                              "sp_reduce_scatter") if p in wire)
            assert 0 < tp_bytes < tp_full, f"compressed TP bytes must be counted: {tp_bytes} of {tp_full}"
        del built
    assert results["stock torchtitan"] == results["megacomp, compression off"], \
        "compression off must match stock torchtitan bit for bit"
    lossy = results["int8 TP + LoCo int4 FSDP"]
    assert lossy[-1] < lossy[0], "the compressed run must train"
    if rank == 0:
        print(f"compression off: the {args.steps} losses equal stock torchtitan's bit for bit")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
