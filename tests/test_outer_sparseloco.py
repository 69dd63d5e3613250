"""SparseLoCo and DCT-momentum DiLoCo on the outer-loop engine (megacomp.outer.sparseloco), real gloo ranks.

- Each outer step equals an fp64 restatement of the paper's rule (accumulator, codec, residual, averaged
  step), the codec taken as the primitive: Dhat_r is decode(encode(e_r)) of replica r's own accumulator.
- With an identity codec, beta 0 and lr 1 the step is parameter averaging (within fp32 round-off).
- Bytes: every exchange sends (R - 1) encodings per rank under the ``outer`` tag, and top-k int2 sends far
  fewer than fp32; the accumulator keeps what was not sent.
- Streaming fragments with a delay work on the same rule; state_dict resumes bit-identically.
"""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import comm
from megacomp.compression import make_codec
from megacomp.outer import DiLoCo, DiLoCoConfig
from test_outer_diloco import flat, inner_step, make_params, run_and_resume

EPS32 = 2.0 ** -24
SPARSE = {"name": "int2", "k": 8, "chunk": 64, "block_size": 32}
DCT = {"name": "bf16", "k": 4, "chunk": 16, "transform": "dct"}


def _rule_body(rank, world, spec, beta, lr, h, outer_steps):
    params = make_params()
    cfg = DiLoCoConfig(outer_steps=h, outer_lr=lr, outer_momentum=beta, algorithm="sparseloco", codec=spec)
    outer = DiLoCo(params, None, cfg)
    codec = make_codec(spec)
    e = torch.zeros(flat(params).numel(), dtype=torch.float64)
    checks = []
    for t in range(outer_steps * h):
        before = outer.outer[0].detach().double().clone()
        inner_step(params, rank, t)
        local = flat(params).double()
        synced = outer.step()
        if not synced:
            continue
        # fp64 restatement: every replica's accumulator and its decoded message, gathered here
        e = beta * e + (before - local)
        sent = codec.decode_flat(codec.encode_flat(e.float()), e.numel()).double()
        all_sent = [torch.empty_like(sent) for _ in range(world)]
        dist.all_gather(all_sent, sent)
        e = e - sent
        want = before - lr * torch.stack(all_sent).mean(0)
        got = flat(params).double()
        scale = before.abs() + local.abs() + e.abs() + torch.stack(all_sent).abs().sum(0)
        bound = (world + 8) * EPS32 * scale * (1 + lr)  # one fp32 rounding per operation on these magnitudes
        acc_bound = 8 * EPS32 * (e.abs() + sent.abs() + before.abs() + local.abs()) * (t + 1)
        checks.append((bool(((got - want).abs() <= bound).all()), (got - want).abs().max().item(),
                       bool(((outer.momenta[0].double() - e).abs() <= acc_bound).all())))
    return checks


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("spec", [None, SPARSE, DCT], ids=["dense", "topk-int2", "dct-topk"])
def test_outer_step_equals_the_papers_rule_in_fp64(world, spec):
    for checks in run_ranks(_rule_body, world, spec, 0.95, 0.8, 2, 3):
        assert len(checks) == 3
        for ok, err, acc_ok in checks:
            assert ok, err
            assert acc_ok


def _tiles(x: torch.Tensor, tile: int = 64) -> torch.Tensor:
    """The reference code's ChunkingTransform without DCT: a matrix cut into h x w tiles (h, w the largest divisors
    of its sides <= 64), a vector into pieces of s (the same rule); one row per tile, row-major inside it."""
    split = lambda n: max(d for d in range(1, min(n, tile) + 1) if n % d == 0)  # noqa: E731
    if x.dim() == 1:
        return x.reshape(-1, split(x.numel()))
    h, w = split(x.shape[0]), split(x.shape[1])
    return x.reshape(x.shape[0] // h, h, x.shape[1] // w, w).permute(0, 2, 1, 3).reshape(-1, h * w)


def _reference_code_body(rank, world, shape, top_k, steps):
    """The engine with SparseLoCo's defaults against the reference code's step (tplr-ai/SparseLoCo's
    src/tplr/sparseloco.py, SparseLoCo.step without quantization, read at QErywan/RobustDiLoCo @276fa59), restated in
    plain fp32 torch: e <- beta e + lr Delta; in every tile the k = max(1, round(h w top_k / 64^2)) entries of
    largest |e| are sent; e <- e - sent; theta <- theta - lr * aggregate. On a tensor whose tiles are contiguous
    (64 columns, or a vector) they are megacomp's chunks, so the codec {name: none, k, chunk} sends the same entries.
    Returns the defaults, and per step: the accumulator equal bit for bit, the error against the paper's aggregate
    (1/R) sum, the error against the code's (scatter_reduce 'mean': the mean over the replicas that sent an entry)
    on the entries every replica sent, and how many entries only some replicas sent (there the code's step is
    R / senders times the paper's)."""
    params = [torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(7)))]
    tile = _tiles(params[0].detach()).shape[1]
    k = max(1, round(tile * top_k / 64 ** 2))
    cfg = DiLoCoConfig(outer_steps=1, algorithm="sparseloco", codec={"name": "none", "k": k, "chunk": tile})
    outer = DiLoCo(params, None, cfg)
    beta, lr = cfg.outer_momentum, cfg.outer_lr
    e = torch.zeros(shape)
    out = []
    for t in range(steps):
        theta = params[0].detach().clone()
        with torch.no_grad():  # a stand-in for H inner steps
            params[0].add_(torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + t)),
                           alpha=0.05 * (rank + 1))
        local = params[0].detach().clone()
        assert outer.step()
        e = e.mul(beta).add(theta - local, alpha=lr)  # the code's p.grad is the pseudo-gradient Delta
        rows = _tiles(e)
        idx = rows.abs().topk(k, dim=-1).indices
        sent = torch.zeros_like(rows).scatter(-1, idx, rows.gather(-1, idx))
        e = e - sent.reshape(shape)  # contiguous tiles: a row is a run of the flat tensor
        both = [torch.empty(2, *sent.shape) for _ in range(world)]
        dist.all_gather(both, torch.stack([sent, torch.zeros_like(sent).scatter(-1, idx, 1.0)]))
        total, senders = sum(x[0] for x in both), sum(x[1] for x in both)
        paper = total / world
        code = torch.where(senders > 0, total / senders.clamp_min(1), 0.0)
        got, before = _tiles(params[0].detach()), _tiles(theta)
        scale = before.abs() + torch.stack([x[0] for x in both]).abs().sum(0)
        out.append((torch.equal(outer.momenta[0], e.reshape(-1)),
                    ((got - (before - lr * paper)).abs() - 4 * EPS32 * scale).max().item(),
                    ((got - (before - lr * code)).abs() - 8 * EPS32 * scale)[senders == world].max().item()
                    if (senders == world).any() else 0.0,
                    int(((senders > 0) & (senders < world)).sum())))
    return (lr, beta), out


@pytest.mark.parametrize("shape", [(128, 64), (256,)], ids=["matrix-64x64-tiles", "vector-64-pieces"])
def test_defaults_and_step_are_the_reference_codes_without_its_quantizer(shape):
    """alpha 1 and beta 0.95 when unset (the paper's runs); top_k 128 per 64 x 64 tile (3.1%, the reference's
    512M sweep; a vector's 64-entry pieces keep round(128 / 64) = 2). megacomp aggregates as the paper writes it,
    (1/R) sum; the code divides each entry by the replicas that sent it, so entries sent by some replicas only
    (counted, and present here) move R / senders times further there."""
    for defaults, steps in run_ranks(_reference_code_body, 2, shape, 128, 3):
        assert defaults == (1.0, 0.95)
        for same_e, paper_excess, code_excess, partial in steps:
            assert same_e and paper_excess <= 0 and code_excess <= 0 and partial > 0


def _untile(rows: torch.Tensor, shape, tile: int = 64) -> torch.Tensor:
    """Inverse of :func:`_tiles` (the reference's ChunkingTransform.decode without DCT)."""
    if len(shape) == 1:
        return rows.reshape(shape)
    split = lambda n: max(d for d in range(1, min(n, tile) + 1) if n % d == 0)  # noqa: E731
    h, w = split(shape[0]), split(shape[1])
    return rows.reshape(shape[0] // h, shape[1] // w, h, w).permute(0, 2, 1, 3).reshape(shape)


def _reference_quantizer(val: torch.Tensor) -> torch.Tensor:
    """The reference code's TopKCompressor._quantize then _dequantize with 4 bins over 6 sigma, restated: values
    centred on their mean, bins of 1.5 sigma (unbiased) around bin 2, each decoded to its bin's mean (fp32)."""
    shift = val.mean()
    c = val - shift
    scale = 6 * (c.norm() / (c.numel() - 1) ** 0.5) / 4 if c.numel() > 1 else torch.tensor(0.0)
    scale = scale if 0 < scale < float("inf") else torch.tensor(1.0)  # one value kept (the 3 x 5 matrix) or none
    q = (c / scale + 2).round().clamp(0, 3).long().flatten()
    sums = torch.zeros(4).scatter_add_(0, q, c.flatten())
    counts = torch.zeros(4).scatter_add_(0, q, torch.ones(q.numel()))
    return (torch.where(counts > 0, sums / counts, 0.0)[q] + shift).view(val.shape)


def _reference_tiles_body(rank, world, top_k, steps):
    """The engine with sparseloco_tiles 'reference' and sparseloco_quantizer 'stat2' against the reference's step
    (SparseLoCo.step with use_quantization, 4 bins, range 6), per tensor in plain fp32 torch: e <- beta e + Delta;
    per tile the max(1, round(h w top_k / 64^2)) entries of largest |e|, their values quantised per tensor; e <- e -
    what they decode to; theta <- theta - lr (1/R) sum of the replicas' decoded tensors (the paper's aggregate,
    summed in replica order). Returns per step: accumulators and weights equal bit for bit, and the bytes."""
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(128, 64, generator=g)), torch.nn.Parameter(torch.randn(256, generator=g)),
              torch.nn.Parameter(torch.randn(3, 5, generator=g)), torch.nn.Parameter(torch.randn(64, 192, generator=g))]
    cfg = DiLoCoConfig(outer_steps=1, algorithm="sparseloco", codec={"name": "int2", "k": top_k, "chunk": 4096},
                       sparseloco_tiles="reference", sparseloco_quantizer="stat2")
    outer = DiLoCo(params, None, cfg)
    beta, lr = cfg.outer_momentum, cfg.outer_lr
    es = [torch.zeros(p.shape) for p in params]
    comm.reset_stats()
    out, wire = [], 0
    for t in range(steps):
        thetas = [p.detach().clone() for p in params]
        with torch.no_grad():  # a stand-in for H inner steps
            for i, p in enumerate(params):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * rank + 10 * t + i)),
                       alpha=0.05 * (rank + 1))
        locals_ = [p.detach().clone() for p in params]
        assert outer.step()
        decoded = []
        for i, (theta, local) in enumerate(zip(thetas, locals_)):
            es[i] = es[i].mul(beta).add(theta - local, alpha=lr)
            rows = _tiles(es[i])
            k = int(max(1, round(rows.shape[1] * top_k / 64 ** 2)))
            idx = rows.abs().topk(k, dim=-1, largest=True, sorted=False).indices
            val = _reference_quantizer(rows.gather(-1, idx))
            sent = _untile(torch.zeros_like(rows).scatter(-1, idx, val), es[i].shape)
            es[i] = es[i] - sent
            decoded.append(sent)
            wire += rows.shape[0] * k * (1 if rows.shape[1] <= 256 else 2) + -(-rows.shape[0] * k // 4) + 20
        mine = torch.cat([d.reshape(-1) for d in decoded])
        slots = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(slots, mine)
        mean = slots[0].clone()
        for s in slots[1:]:
            mean.add_(s)
        want = torch.cat([th.reshape(-1) for th in thetas]).add(mean.div(world), alpha=-lr)
        out.append((torch.equal(outer.momenta[0], torch.cat([e.reshape(-1) for e in es])),
                    torch.equal(flat(params), want)))
    st = comm.stats()["outer"]
    return out, (st.calls, st.wire_bytes, (world - 1) * wire, (world - 1) * steps * outer.tiles[0].wire_bytes())


def test_reference_tiles_and_stat2_reproduce_the_reference_codes_step_bit_for_bit():
    """sparseloco_tiles 'reference' + sparseloco_quantizer 'stat2': per-tensor 64 x 64 tiles (a 128 x 64 matrix: 2
    tiles keeping 128; a 256-vector: pieces of 64 keeping round(64 * 128 / 4096) = 2; a 3 x 5 matrix: one tile,
    round(15 * 128 / 4096) = 0 -> 1; a 64 x 192 matrix: 3 tiles side by side, not runs of the flat tensor) and the
    statistical 2-bit code, accumulator and weights bit for bit; the bytes
    counted are the Tiles' wire_bytes: indices, codes 4 per byte, shift and a 4-entry table per tensor."""
    for steps, (calls, counted, restated, wire) in run_ranks(_reference_tiles_body, 2, 128, 3):
        assert steps and all(same_e and same_theta for same_e, same_theta in steps), steps
        assert calls == 3 and counted == restated == wire


def _averaging_body(rank, world):
    params = make_params()
    outer = DiLoCo(params, None, DiLoCoConfig(outer_steps=1, outer_lr=1.0, outer_momentum=0.0, algorithm="sparseloco"))
    inner_step(params, rank, 0)
    local = flat(params).double()
    all_local = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(all_local, local)
    outer.step()
    mean = torch.stack(all_local).mean(0)
    err = (flat(params).double() - mean).abs()
    bound = (world + 4) * EPS32 * (torch.stack(all_local).abs().max(0).values + make_params_flat().abs())
    return bool((err <= bound).all()), bool((outer.momenta[0] == 0).all())


def make_params_flat():
    return flat(make_params()).double()


def test_identity_codec_beta0_lr1_is_parameter_averaging():
    for ok, zero in run_ranks(_averaging_body, 3):
        assert ok and zero  # nothing is left in the accumulator when everything was sent


def _bytes_body(rank, world, spec):
    params = make_params()
    outer = DiLoCo(params, None, DiLoCoConfig(outer_steps=2, algorithm="sparseloco", codec=spec, outer_momentum=0.9))
    comm.reset_stats()
    for t in range(6):
        inner_step(params, rank, t)
        outer.step()
    st = comm.stats()["outer"]
    n = flat(params).numel()
    return st.calls, st.wire_bytes, st.uncompressed_bytes, make_codec(spec).wire_bytes(n), n, \
        outer.momenta[0].abs().sum().item()


@pytest.mark.parametrize("spec", [SPARSE, DCT], ids=["topk-int2", "dct-topk"])
def test_bytes_are_r_minus_1_encodings_per_exchange(spec):
    world = 3
    for calls, wire, raw, enc, n, left in run_ranks(_bytes_body, world, spec):
        assert calls == 3 and wire == 3 * (world - 1) * enc and raw == 3 * (world - 1) * 4 * n
        assert wire < 0.2 * raw and left > 0  # the unsent part waits in the accumulator


def _resume_body(rank, world, cfg):
    same, in_flight, _ = run_and_resume(rank, cfg, 5, 11)
    return same, in_flight


@pytest.mark.parametrize("cfg", [
    DiLoCoConfig(outer_steps=3, algorithm="sparseloco", codec=SPARSE, outer_momentum=0.9),
    DiLoCoConfig(outer_steps=4, algorithm="sparseloco", codec=DCT, fragments=2, delay=1, outer_momentum=0.9),
    DiLoCoConfig(outer_steps=4, algorithm="sparseloco", codec={"name": "int2", "k": 8, "chunk": 16}, fragments=2,
                 delay=1, sparseloco_tiles="reference", sparseloco_quantizer="stat2"),
], ids=["sparseloco", "streaming-dct", "streaming-reference-tiles-stat2"])
def test_resumes_bit_identically(cfg):
    for same, in_flight in run_ranks(_resume_body, 2, cfg):
        assert same


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="accumulator is its error feedback"):
        DiLoCoConfig(algorithm="sparseloco", codec=SPARSE, error_feedback="ef")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        DiLoCoConfig(algorithm="sparseloco", outer_momentum=1.5)
    DiLoCoConfig(algorithm="sparseloco", outer_momentum=1.0)  # beta 1: classic error feedback, allowed
    with pytest.raises(ValueError, match="needs a top-k codec whose chunk is a square tile"):
        DiLoCoConfig(algorithm="sparseloco", codec={"name": "int2", "k": 8, "chunk": 60}, sparseloco_tiles="reference")
    with pytest.raises(ValueError, match="set sparseloco_tiles 'reference' too"):
        DiLoCoConfig(algorithm="sparseloco", codec=SPARSE, sparseloco_quantizer="stat2")
    with pytest.raises(ValueError, match="are SparseLoCo's options"):
        DiLoCoConfig(algorithm="diloco", sparseloco_tiles="reference")


def test_pretraining_with_sparseloco_and_dct_diloco_logs_outer_traffic_and_resumes(tiny_config, tmp_path):
    from dataclasses import replace

    from megacomp.compression import make_codec
    from megacomp.outer.sparseloco import DEFAULT_CODEC
    from megacomp.training.features.outer_loop import outer_config
    from test_outer_diloco import _pretrain_body

    cfg = replace(tiny_config, train_iters=6, outer_algorithm="sparseloco", num_replicas=4, outer_steps=2)
    oc = outer_config(cfg)  # the defaults: top-64 of 4096 in int2, alpha 1, beta 0.95
    assert (oc.algorithm, oc.outer_lr, oc.outer_momentum) == ("sparseloco", 1.0, 0.95)
    assert make_codec(oc.codec) == DEFAULT_CODEC
    dct = replace(cfg, outer_codec="{name: bf16, transform: dct, chunk: 64, k: 4}")  # DCT-momentum DiLoCo
    assert make_codec(outer_config(dct).codec).transform == "dct"
    for run in (cfg, dct):
        full = run_ranks(_pretrain_body, 4, run)[0]
        outer = [t.get("outer", [0, 0]) for _, t in full]
        assert [w > 0 for w, _ in outer] == [False, True] * 3  # one all-gather every 2 steps
        assert all(0 < w < 0.1 * u for w, u in outer if u)  # a few percent of the coefficients, small values
        ck = str(tmp_path / f"ck-{run.outer_codec is None}")
        first = run_ranks(_pretrain_body, 4, replace(run, save=ck, exit_interval=3))[0]  # mid-cycle
        rest = run_ranks(_pretrain_body, 4, replace(run, load=ck))[0]
        assert [loss for loss, _ in first + rest] == [loss for loss, _ in full]


def test_pretraining_flags_reach_the_reference_options(tiny_config):
    from dataclasses import replace

    from megacomp.training.features.outer_loop import outer_config

    cfg = replace(tiny_config, outer_algorithm="sparseloco", num_replicas=2, outer_sparseloco_tiles="reference",
                  outer_sparseloco_quantizer="stat2", outer_codec="{name: int2, k: 128, chunk: 4096}")
    oc = outer_config(cfg)
    assert (oc.sparseloco_tiles, oc.sparseloco_quantizer, oc.codec.k) == ("reference", "stat2", 128)
    assert "sparseloco_tiles" not in outer_config(replace(cfg, outer_sparseloco_tiles="flat",
                                                          outer_sparseloco_quantizer="codec")).to_dict()
