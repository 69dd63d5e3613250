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
], ids=["sparseloco", "streaming-dct"])
def test_resumes_bit_identically(cfg):
    for same, in_flight in run_ranks(_resume_body, 2, cfg):
        assert same


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="accumulator is its error feedback"):
        DiLoCoConfig(algorithm="sparseloco", codec=SPARSE, error_feedback="ef")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        DiLoCoConfig(algorithm="sparseloco", outer_momentum=1.5)
    DiLoCoConfig(algorithm="sparseloco", outer_momentum=1.0)  # beta 1: classic error feedback, allowed


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
