"""The target split by tensor parallelism (every rank runs every layer with its share of the
heads and MLP width, mlx-lm's `shard()`), on 3 ranks over loopback: the decoders on rank 0
give the same tokens as under one process, a split that does not divide evenly is refused
before any rank waits for another, and a rank that goes silent ends the run at the bound."""

import json

from mirror_mlx.distributed.tensor import choose
from mirror_mlx.errors import InvalidParameter

import pytest

from tests.distributed.conftest import run_ranks
from tests.families.tiny import tiny
from tests.helpers import write_tiny_gguf


def test_auto_shards_where_heads_and_width_divide(target):
    # The default target: 9 heads, 3 key/value heads, MLP width 1536.
    assert choose(target.model, "auto", 3, None) == "tensor"
    assert choose(target.model, "auto", 2, None) == "pipeline"
    assert choose(target.model, "auto", 3, "10,10,10") == "pipeline"
    assert choose(target.model, "pipeline", 3, None) == "pipeline"
    with pytest.raises(InvalidParameter, match="9 attention heads and 3 key/value heads do "
                                               "not divide by 2 ranks.*that divide them all: 3"):
        choose(target.model, "tensor", 2, None)
    with pytest.raises(InvalidParameter, match="--split gives a pipeline's layers"):
        choose(target.model, "tensor", 3, "10,10,10")


@pytest.mark.parametrize("family", ["phi3", "gemma2", "gemma3_text"])
def test_families_mlx_lm_cannot_shard_are_refused(family):
    model = tiny(family, layers=2)
    with pytest.raises(InvalidParameter, match=f"no tensor-parallel split .* '{family}'.*"
                                               "--parallel pipeline"):
        choose(model, "tensor", 2, None)
    assert choose(model, "auto", 2, None) == "pipeline"


def test_three_ranks_speculative_decoding_equals_single_process(single, default_gguf, capfd):
    """`--parallel auto` on 3 ranks shards the default target, and Mirror-SD's tokens are one
    process's AR tokens: the shares' sums change only the float rounding of the target's
    logits. SD is not run here: its step, one whole forward over a window, is what the prefill
    already runs through the sharded layers, and SD over ranks runs in the pipeline tests; nor
    is AR, whose step is Mirror-SD's verification over one token. 8 tokens: 3 ranks on 2 cores
    run about a token in 2 s (seeded sampling and sessions are checked on the pipeline)."""
    status, out, err = run_ranks(capfd, 3, "--model", str(default_gguf), "--parallel", "auto",
                                 "--branch-budget", "1", "--max-tokens", "8",
                                 "--modes", "mirror")
    assert status == 0, err
    mirror = json.loads(out.strip().splitlines()[-1])["mirror"]
    stats = mirror["stats"]
    assert (stats["ranks"], stats["parallel"], stats["split"]) == (3, "tensor", [])
    assert stats["comm_s"] > 0  # 62 all-sums a forward, timed at start
    assert mirror["token_ids"] == single["ar"].token_ids[:8]
    assert stats["exit_positions"] > 0
    assert stats["exit_covered"] / stats["exit_positions"] >= 0.5, stats


def test_two_ranks_are_refused_with_what_does_not_divide(default_gguf, capfd):
    status, out, err = run_ranks(capfd, 2, "--model", str(default_gguf), "--parallel",
                                 "tensor", "--modes", "ar")
    assert status == 1
    assert out.strip() == ""
    assert err.count("mirror-mlx: error") == 1, err
    assert "--parallel tensor: its 9 attention heads and 3 key/value heads do not divide by " \
           "2 ranks" in err



def test_a_silent_rank_ends_the_run_at_the_bound(default_gguf, tmp_path, capfd):
    """Two tensor ranks (a tiny llama whose 4 heads divide by 2), the follower alive but
    silent inside a forward: no other rank's bound can end the run, and rank 0 waits for the
    forward's all-reduces where the decoders read its logits, out of any transfer's bound.
    The forward's own bound ends the run with one error."""
    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny, default_gguf)
    status, out, err = run_ranks(capfd, 2, "--model", str(tiny), "--parallel", "tensor",
                                 "--modes", "ar", "--hang-after", "3", "--timeout", "5")
    assert status == 1
    assert out.strip() == ""
    assert err.count("mirror-mlx: error") == 1, err
    assert "no answer within 5 s while running a forward's layers with the other ranks" \
        in err
