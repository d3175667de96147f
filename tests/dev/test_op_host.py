"""``dev/gpu/tools/op_host.py``: its options, and one op timed and profiled end to end (through the interpreter
on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import triton_kernels_device

DEVICE = triton_kernels_device()
TOOLS = Path(__file__).resolve().parents[2] / "dev" / "gpu" / "tools"


@pytest.fixture
def op_host(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import op_host

    return op_host


def test_options_name_what_they_refuse(op_host, tmp_path):
    args = op_host.parse_args(["--out", str(tmp_path), "--ops", "rms_norm,recurrence_gdn", "--calls", "5"])
    assert args.ops == ["rms_norm", "recurrence_gdn"] and args.calls == 5 and args.warmup == 20
    assert "attention" in op_host.parse_args(["--out", str(tmp_path)]).ops
    for bad in (["--ops", "rms_norm,softmax"], ["--calls", "0"]):
        with pytest.raises(SystemExit):
            op_host.parse_args(bad)


def test_one_op_timed_and_profiled(op_host, tmp_path, capsys):
    rows = op_host.main(["--out", str(tmp_path), "--ops", "l2_norm,mamba2_log_decay", "--calls", "1", "--warmup", "0",
                         "--device", DEVICE, "--cprofile"])
    assert [(r["op"], r["mode"]) for r in rows] == [(op, mode) for op in ("l2_norm", "mamba2_log_decay")
                                                    for mode in ("forward", "forward+backward")]
    assert all(r["host_us"] > 0 for r in rows)
    assert json.loads((tmp_path / "op_host.json").read_text())["rows"] == rows
    assert "tottime" in (tmp_path / "op_host_l2_norm_forward_backward.txt").read_text()
    assert "l2_norm              forward+backward" in capsys.readouterr().out
