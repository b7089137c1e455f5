"""bench.spec_speedup refuses the options its chosen shape does not read."""

from __future__ import annotations

import pytest

from bench import spec_speedup


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ks", "4"], "--ks: not used with --shape tiny"),
        (["--shape", "8b", "--temperature", "1", "--forced-al", "3"], "--temperature, --forced-al: not used"),
        (["--shape", "8b", "--k", "5"], "--k: not used with --shape 8b"),
    ],
)
def test_options_of_the_other_shape_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        spec_speedup.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
