"""dev/kernels/ncu_lines.py: per-Python-line attribution of an Nsight Compute source page."""

import csv
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "dev" / "kernels" / "ncu_lines.py"
spec = importlib.util.spec_from_file_location("ncu_lines", SCRIPT)
ncu_lines = importlib.util.module_from_spec(spec)
sys.modules["ncu_lines"] = ncu_lines  # dataclasses look their module up there
spec.loader.exec_module(ncu_lines)

HEADER = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "# Samples", "Instructions Executed",
          "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]


def sass(op, samples, inst, long_sb, wait):
    return ["", "", "0x10", op, str(samples), "0", str(samples), str(inst), str(long_sb), str(wait), "99"]


def test_samples_and_stalls_add_up_per_kernel_and_line(tmp_path):
    rows = [["File Path", "/x/common.py"], ["Function Name", "grads_kernel"], HEADER,
            ["220", "return tl.exp(x)", "-", "-", "9", "0", "9", "6", "5", "4"],
            sass("FMUL R1, R2, R3", 3, 4, 1, 2), sass("@P0 MUFU.EX2 R1, R1", 6, 2, 4, 2),
            ["", "", "...", "...", "-", "-", "-", "-", "-", "-", "-"],
            ["File Path", "/x/chunk_bwd.py"], ["Function Name", "grads_kernel"], HEADER,
            ["40", "dq = mm(a, b)", "-", "-", "1", "0", "1", "1", "1", "0"],
            sass("HGMMA.64x32x16.F32.BF16 R0", 1, 1, 1, 0),
            ["File Path", "/x/chunk_fwd.py"], ["Function Name", "output_kernel"], HEADER,
            ["7", "o = x", "-", "-", "2", "0", "2", "2", "0", "2"], sass("FADD R1, R1, R2", 2, 2, 0, 2)]
    path = tmp_path / "page.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    kernels = ncu_lines.read_source_page(str(path))
    assert set(kernels) == {"grads_kernel", "output_kernel"}
    exp = kernels["grads_kernel"]["common.py:220"]
    assert (exp.samples, exp.instructions) == (9, 6)  # the SASS rows under the line, not the line's own totals
    assert exp.stalls == {"long_sb": 5, "wait": 4}  # "Not Issued" columns are not counted twice
    assert exp.sass == {"FMUL": 3, "MUFU.EX2": 6}  # a predicate is not an opcode
    lines = ncu_lines.report(kernels["grads_kernel"], top=5, sass=("common.py:220",))
    assert "long_sb 60%" in lines[0]
    assert lines[1].split()[:3] == ["90.0%", "85.7%", "common.py:220"]
    assert lines[-1].startswith("common.py:220: MUFU.EX2 60.0%, FMUL 30.0%")
