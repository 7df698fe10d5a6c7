"""The target split over processes (ring backend on loopback, launched by mlx.launch): the
decoders across ranks give single-process AR's tokens, the features and the early exit that
travel back from the stages are the target's, and a dead rank or different weights end the
run with one error instead of a hang."""

import json
from pathlib import Path

from mirror_mlx.cli import main as cli_main

from tests.distributed.conftest import PROMPT, free_ports, run_ranks


def test_generate_on_two_ranks_equals_single_process(single, capfd, tmp_path):
    """The CLI relaunches itself on 2 ranks from an mlx.launch hostfile (the other tests name
    --hosts); SD's tokens are AR's, and with a fixed gamma it accepts exactly what it accepts
    in one process: the draft got the target's features (layers 3 and 15 of 30 run on rank
    1)."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2}))
    status = cli_main(["generate", "--prompt", PROMPT, "--max-tokens", "16", "--json",
                       "--mode", "sd", "--gamma", "4", "--hostfile", str(hostfile),
                       "--ring-port", str(free_ports(2))])
    out, err = capfd.readouterr()
    assert status == 0, err
    reply = json.loads(out.strip().splitlines()[-1])
    assert reply["token_ids"] == single["ar"].token_ids
    stats = reply["stats"]
    # auto: the default target's 9 heads do not divide by 2 ranks, so it is pipelined.
    assert (stats["ranks"], stats["split"], stats["parallel"]) == (2, [15, 15], "pipeline")
    # A probe's round trip at start: transfers take time, and far less than a step.
    assert 0 < stats["comm_s"] < stats["decode_s"] / stats["target_steps"]
    assert (stats["draft_tokens"], stats["accepted_tokens"]) == \
        (single["sd"].stats.draft_tokens, single["sd"].stats.accepted_tokens)


def test_three_ranks_speculative_decoders_equal_single_process(single, default_gguf, capfd):
    """SD and Mirror-SD over 3 ranks with rank 0 holding only layers 27-30: the early exit
    (after layer 25) and the draft's feature layers (3, 15, 25) come back from ranks 1 and 2,
    rank 2 sending the exit ahead of the rest (Mirror-SD runs first: SD after it reads its
    features from there). AR over these ranks runs in the interleaved sessions at the end."""
    status, out, err = run_ranks(capfd, 3, "--model", str(default_gguf), "--split",
                                 "4,13,13", "--branch-budget", "1", "--interleave", "--sampled",
                                 "--modes", "mirror,sd")
    assert status == 0, err
    replies = json.loads(out.strip().splitlines()[-1])
    for mode in ("sd", "mirror"):
        assert replies[mode]["token_ids"] == single["ar"].token_ids, mode
        assert replies[mode]["stats"]["split"] == [4, 13, 13]
    sd = replies["sd"]["stats"]
    assert (sd["draft_tokens"], sd["accepted_tokens"]) == \
        (single["sd"].stats.draft_tokens, single["sd"].stats.accepted_tokens)
    mirror = replies["mirror"]["stats"]
    # The exit read the wrong hidden state -> its guesses would almost never hold the token.
    assert mirror["exit_positions"] > 0
    assert mirror["exit_covered"] / mirror["exit_positions"] >= 0.5, mirror
    # Rank 2 holds the exit: it sent it, with the features, ahead of the forward's end in
    # Mirror-SD's forwards and in those after (the layer stays wanted), SD's among them, whose
    # acceptance (above) shows the features it read from there are the target's.
    assert replies["early_exits"] >= mirror["target_steps"] + sd["target_steps"] > 0
    # Seeded sampling: the same draws on the same target distributions.
    assert replies["sd-sampled"]["token_ids"] == single["sd-sampled"].token_ids
    # The stages keep a cache per session: the first continues after the second ran, from its
    # own cached prompt, with one process's tokens.
    interleaved = replies["interleaved"]
    assert interleaved["first"] == single["ar"].token_ids[:4]
    assert interleaved["again"] == interleaved["first"] and interleaved["cached"] > 0


def test_dead_rank_ends_the_run_with_one_error(default_gguf, capfd):
    status, out, err = run_ranks(capfd, 2, "--model", str(default_gguf), "--modes", "ar",
                                 "--die-after", "3", "--timeout", "60")
    assert status == 1
    assert out.strip() == ""
    assert err.count("mirror-mlx: error") == 1, err
    assert "rank 1" in err


def test_silent_rank_ends_the_run_at_the_bound(default_gguf, capfd):
    """A rank alive but silent: only the watchdog can end the wait inside MLX."""
    status, out, err = run_ranks(capfd, 2, "--model", str(default_gguf), "--modes", "ar",
                                 "--hang-after", "3", "--timeout", "8")
    assert status == 1
    assert out.strip() == ""
    assert err.count("mirror-mlx: error") == 1, err
    assert "no answer within 8 s while waiting for hidden states from rank 1" in err


def test_different_weights_are_refused(default_gguf, tmp_path, capfd):
    other = tmp_path / "other.gguf"
    data = bytearray(Path(default_gguf).read_bytes())
    data[-100] ^= 1  # one bit of the last tensor
    other.write_bytes(data)
    status, out, err = run_ranks(capfd, 2, "--model", str(default_gguf), "--modes", "ar",
                                 "--other-model", str(other))
    assert status == 1
    assert out.strip() == ""
    assert err.count("mirror-mlx: error") == 1, err
    assert "rank 1 loaded different weights" in err
