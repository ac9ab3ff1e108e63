"""A shrunk tiny checkpoint and a helper that runs one command line expected to fail."""

import pytest

from flashdsa.cli import main


@pytest.fixture(scope="session")
def shrunk(tmp_path_factory):
    from flashdsa.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("shrunk"), shrink=True)


@pytest.fixture
def user_error(capsys):
    """``user_error(argv)``: run ``flashdsa argv``, check it exits 2 with exactly one error line
    and no traceback on stderr, and return that line."""

    def run(argv: list[str]) -> str:
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "error" in line.lower()]
        assert code == 2, err
        assert len(lines) == 1 and "Traceback" not in err, err
        return lines[0]

    return run
