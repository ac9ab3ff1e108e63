"""GPU: flashdsa check in production mode (FP8 caches, FP8 indexer, GPU kernels) on the
full-width tiny checkpoint; prints the measured figures."""

import pytest

from flashdsa.cli import main
from flashdsa.models.tiny import make_tiny_checkpoint


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_check_production_mode_on_gpu(tmp_path, capsys, fp8):
    path = make_tiny_checkpoint(tmp_path, fp8=fp8)
    code = main(["check", "--model", str(path), "--mode", "production", "--device", "cuda", "--tokens", "512"])
    print(capsys.readouterr().out)
    assert code == 0
