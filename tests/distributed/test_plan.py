"""Which rank runs which layers, and the bad splits and host lists refused before any rank
starts."""

from mirror_mlx.cli import main as cli_main
from mirror_mlx.distributed.plan import layer_counts, layer_range
from mirror_mlx.errors import InvalidParameter

import pytest


def test_rank_zero_runs_the_last_layers():
    counts = layer_counts(30, 3)
    assert counts == (10, 10, 10)
    assert [layer_range(counts, r) for r in (1, 2, 0)] == [(0, 10), (10, 20), (20, 30)]
    counts = layer_counts(30, 3, "4,13,13")
    assert [layer_range(counts, r) for r in (1, 2, 0)] == [(0, 13), (13, 26), (26, 30)]
    assert layer_counts(31, 2) == (16, 15)


@pytest.mark.parametrize("split", ["15", "15,14", "0,30", "a,b", "10,10,10"])
def test_bad_splits_are_refused(split):
    with pytest.raises(InvalidParameter, match="--split"):
        layer_counts(30, 2, split)


def test_one_host_is_refused_before_launching(capsys):
    assert cli_main(["generate", "--prompt", "x", "--hosts", "127.0.0.1"]) == 1
    assert "--hosts needs at least 2 addresses" in capsys.readouterr().err
