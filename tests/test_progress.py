"""The progress display as a log sees it (stderr not a terminal)."""

import time

from mirror_mlx.progress import Progress


def test_log_gets_a_line_per_tenth_and_one_while_a_tenth_is_slow(capsys):
    p = Progress("bench", 100, "gen", log_every_s=0.2)
    p.advance(1)  # the first line
    p.advance(1)  # same tenth, too soon: nothing
    time.sleep(0.25)
    p.advance(1)  # same tenth, but a while since the last line
    p.advance(10)  # a new tenth
    p.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("%")[1].split("/")[0].strip() for line in lines] == \
        ["1 gen", "3 gen", "13 gen"], lines
