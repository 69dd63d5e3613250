"""Pretraining with DP exchanges hop by hop (megacomp.comm.hierarchical) on 4 real ranks placed as 2 nodes x 2 ranks
(``ranks_per_node=2``: these forked ranks have no launcher, so the placement is the setting's).

- compression off: the same losses, bit for bit, hop by hop and flat (both are torch's collectives);
- loco4_qwz: each hop's bytes under its link kind, the slow hop carrying a third of what the flat exchange counts
  (one chunk per rank instead of three), and a kill-and-resume continuing the uninterrupted run's losses exactly
  (the error feedback of every hop is in the checkpoint);
- bad settings: one line each.
"""
from dataclasses import replace

import pytest

from distributed import RankFailure, run_ranks
from megacomp.config import load_yaml
from megacomp.training import Trainer
from megacomp.training.arguments import REPO_CONFIGS


@pytest.fixture(scope="module")
def base(tiny_config):
    return replace(tiny_config, num_layers=4, ranks_per_node=2, train_iters=4)


def _train_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        hops = trainer.dp_hierarchy.links if trainer.dp_hierarchy is not None else ()
    finally:
        trainer.close()
    return [(h["loss"], h["traffic"]) for h in history], hops


def test_compression_off_is_the_same_hop_by_hop_and_flat(base):
    hier, hops = run_ranks(_train_body, 4, base)[0]
    flat, flat_hops = run_ranks(_train_body, 4, replace(base, dp_collectives="flat"))[0]
    assert hops == ("intra_node", "inter_node") and flat_hops == ()
    assert [h[0] for h in hier] == [h[0] for h in flat]
    assert hier[-1][1] == flat[-1][1]  # uncompressed messages are torch's flat collectives: the same counts


def test_compressed_hops_count_per_link_and_resume_exactly(base, tmp_path):
    every_bucket = {**load_yaml(str(REPO_CONFIGS / "compression" / "loco4_qwz.yaml")), "min_compress_numel": 0}
    cfg = replace(base, compression=every_bucket, train_iters=4)
    full, _ = run_ranks(_train_body, 4, cfg)[0]
    flat, _ = run_ranks(_train_body, 4, replace(cfg, dp_collectives="flat"))[0]
    traffic, flat_traffic = full[-1][1], flat[-1][1]
    for path in ("dp_gradient", "dp_parameter"):
        intra = traffic[f"{path}@intra_node"]
        assert intra[0] == intra[1] and intra[0] > 0  # the fast hop travels uncompressed
        # the slow hop: each rank sends one encoded chunk of a quarter of a bucket to its peer on the other node; the
        # flat form sends three (one to every other rank). The bucket of 1-D parameters stays uncompressed (the
        # optimizer's policy), a torch collective over the whole group in both: X bytes, found from the uncompressed
        # counts (hop by hop u = a + X, flat 3a + X)
        (hw, hu), (fw, fu) = traffic[path], flat_traffic[path]
        x = (3 * hu - fu) // 2
        assert 0 < x < hu and fw - x == 3 * (hw - x)
    saved = replace(cfg, save=str(tmp_path / "ckpt"))
    first, _ = run_ranks(_train_body, 4, replace(saved, exit_interval=2))[0]
    rest, _ = run_ranks(_train_body, 4, replace(saved, load=str(tmp_path / "ckpt")))[0]
    assert [h[0] for h in first + rest] == [h[0] for h in full]


def test_bad_settings_one_line_each(base):
    with pytest.raises(RankFailure, match="a codec is set for the inter_site hop, which this group does not cross "
                                          r"\(its hops: intra_node, inter_node\)"):
        run_ranks(_train_body, 4, replace(base, compression={"dp_gradient": {"inter_site": "int4"}}))
    with pytest.raises(RankFailure, match="--ranks-per-node 3 does not divide the 4 ranks"):
        run_ranks(_train_body, 4, replace(base, ranks_per_node=3))
    with pytest.raises(RankFailure, match="--dp-collectives must be auto .* or flat, got 'ring'"):
        run_ranks(_train_body, 4, replace(base, dp_collectives="ring"))
