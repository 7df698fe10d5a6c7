"""The progress display as a log sees it (stderr not a terminal)."""

import time

from mirror_mlx.progress import Progress


def test_log_gets_a_line_per_tenth_and_one_while_a_tenth_is_slow(capsys):
    # A second between lines: two calls in a row stay inside it even on a stalled machine.
    p = Progress("bench", 100, "gen", log_every_s=1.0)
    p.advance(1)  # the first line
    p.advance(1)  # same tenth, too soon: nothing
    time.sleep(1.05)
    p.advance(1)  # same tenth, but a while since the last line
    p.advance(10)  # a new tenth
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("%")[1].split("/")[0].strip() for line in lines] == \
        ["1 gen", "3 gen", "13 gen"], lines
