"""megacomp.tensor_parallel.tied_embedding through GPTConfig.tied_embedding_grad_in_place: the same loss, gradients
and LOMO / AdaLomo updates as the default graph, bit for bit (TP 1, TP 2, TP 2 with sequence parallelism, with
repeated token ids), one [V/tp, h] gradient buffer for the tied weight instead of two (measured), the default
gradient when the output layer is not in the loss, and a RuntimeError instead of a lost gradient when the weight
is used a third time."""
import pytest
import torch

from distributed import run_ranks
from megacomp import parallel_state
from megacomp.config import ModelParallelConfig
from megacomp.models.gpt import GPTConfig, GPTModel
from megacomp.training.memory import MemoryTracker

V, S, B = 64, 16, 2
CFG = dict(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_layers=2, vocab_size=V, max_seq_length=S,
           seed=7)


def _model(tp: int, sp: bool, in_place: bool, **kw) -> GPTModel:
    groups = parallel_state.get_process_groups() if parallel_state.model_parallel_is_initialized() else \
        parallel_state.initialize_model_parallel(tp)
    cfg = GPTConfig(**CFG, tied_embedding_grad_in_place=in_place, **kw)
    return GPTModel(cfg, ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp,
                                             process_groups=groups))


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V // 4, (B, S), generator=g)  # a quarter of the vocabulary: ids repeat
    return ids, torch.randint(0, V, (B, S), generator=g)


def _grads_body(rank, world, tp, sp):
    out = {}
    for in_place in (False, True):
        model = _model(tp, sp, in_place)
        ids, labels = _batch(0)
        loss = model(ids, labels)
        loss.backward()
        out[in_place] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_same_loss_and_gradients_bit_for_bit(tp, sp):
    for out in run_ranks(_grads_body, tp, tp, sp):
        (loss0, g0), (loss1, g1) = out[False], out[True]
        assert torch.equal(loss0, loss1)
        assert g0.keys() == g1.keys()
        differ = [n for n in g0 if not torch.equal(g0[n], g1[n])]
        assert not differ, differ


def _memory_body(rank, world, tp):
    peaks = {}
    for in_place in (False, True):
        model = _model(tp, False, in_place)
        ids, labels = _batch(1)
        t = MemoryTracker()
        with t:
            t.watch_params(model)
            with t.category("act"):
                loss = model(ids, labels)
            t.watch_graph(loss, model)
            t.reset_peak()
            loss.backward()
        partials = [b for n, b in t.grad_live_at_peak if n == "word_embeddings.weight (partial)"]
        peaks[in_place] = (t.cat_peak["grad"], partials, t.current["grad"])
    emb = model.word_embeddings.weight
    parallel_state.destroy_model_parallel()
    return peaks, emb.numel() * emb.element_size()


@pytest.mark.parametrize("tp", [1, 2])
def test_one_gradient_buffer_for_the_tied_weight(tp):
    """Plain backward keeps every gradient: the default's peak is all gradients plus the second [V/tp, h] partial
    (alive until autograd sums the two), the in-place one's is all gradients; the same gradients remain."""
    for (peaks, emb_bytes) in run_ranks(_memory_body, tp, tp):
        (peak0, partials0, end0), (peak1, partials1, end1) = peaks[False], peaks[True]
        assert partials0 == [emb_bytes, emb_bytes]
        assert peak1 == end1 == end0 and peak0 == end0 + emb_bytes


def _lomo_body(rank, world, tp, kind):
    from megacomp.optimizer import AdaLomo, Lomo
    from megacomp.training.features.lomo_fused import tie_for_fused_update

    out = {}
    for in_place in (False, True):
        model = _model(tp, False, False, cross_entropy_inplace_backward=False)
        groups = parallel_state.get_process_groups()
        fired = []  # before the optimizer's hook, which takes the gradient away
        model.word_embeddings.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is not None))
        cls = AdaLomo if kind == "adalomo" else Lomo
        opt = cls(model, lr=0.05, clip_grad_norm=1.0, tp_group=groups.tp if tp > 1 else None, dp_group=groups.dp)
        if in_place:
            tie_for_fused_update(model, opt)
            assert model.cfg.tied_embedding_grad_in_place
        for step in range(3):
            ids, labels = _batch(10 + step)
            loss = model(ids, labels)
            opt.grad_norm(loss)
            opt.fused_backward(loss)
        out[in_place] = ({n: p.detach().clone() for n, p in model.named_parameters()}, fired)
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.parametrize("kind", ["lomo", "adalomo"])
@pytest.mark.parametrize("tp", [1, 2])
def test_lomo_updates_are_the_same_bits(tp, kind):
    """LOMO / AdaLomo with norm clipping (two backward passes a step): the tied weight's hook fires once a pass with
    the summed gradient, and the parameters after three steps are the default path's bits."""
    for out in run_ranks(_lomo_body, tp, tp, kind):
        (p0, n0), (p1, n1) = out[False], out[True]
        assert n0 == n1 == [True] * 6
        differ = [n for n in p0 if not torch.equal(p0[n], p1[n])]
        assert not differ, differ


def _edge_body(rank, world):
    model = _model(1, False, True)
    ref = _model(1, False, False)
    ids, labels = _batch(2)
    # no output layer in the loss: the lookup's default dense gradient
    for m in (model, ref):
        m.embed(ids, m.tied_embedding_grad()).square().sum().backward()
    lookup_only = torch.equal(model.word_embeddings.weight.grad, ref.word_embeddings.weight.grad)
    # no lookup in the pass: the output layer's gradient goes to the weight as usual, and is not kept after
    hidden = torch.randn(S, B, CFG["hidden_size"], generator=torch.Generator().manual_seed(3))
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        m.logits(hidden, m.tied_embedding_grad()).square().sum().backward()
    head_only = torch.equal(model.word_embeddings.weight.grad, ref.word_embeddings.weight.grad)
    head_only = head_only and model.tied_embedding_grad().partial is None
    # a third use of the weight in the same backward pass: refused, not summed wrongly
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels) + model.word_embeddings.weight.square().sum()
    try:
        loss.backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    # without gradients: the default graph (nothing kept)
    with torch.no_grad():
        unused = model.tied_embedding_grad() is None
    parallel_state.destroy_model_parallel()
    return lookup_only, head_only, error, unused


def test_either_use_alone_gives_the_default_gradient_and_a_third_use_raises():
    lookup_only, head_only, error, unused = run_ranks(_edge_body, 1)[0]
    assert lookup_only and head_only and unused
    assert error is not None and "third time" in error, error


def test_default_is_off():
    assert GPTConfig(hidden_size=8, num_attention_heads=2).tied_embedding_grad_in_place is False
