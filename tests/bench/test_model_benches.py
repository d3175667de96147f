"""``linmem bench models`` and ``linmem bench decode`` end to end on CPU at tiny sizes (peers that are not
installed are skipped; HF Llama runs), and the pieces that decide what a cell reports."""

from __future__ import annotations

import importlib.util
import json
import sys
import types

import pytest
import torch

from linmem.bench import decode, models, peers

TINY = ["--device", "cpu", "--dtype", "float32", "--hidden-size", "64", "--layers", "2", "--vocab-size", "128",
        "--warmup", "1", "--steps", "1"]
HAS_FLA = importlib.util.find_spec("fla") is not None


def test_models_bench_times_linmem_and_llama_and_writes_its_tables(tmp_path):
    assert models.main(TINY + ["--models", "gla", "--peers", "llama,fla-gla", "--seq-lens", "16,32",
                               "--tokens", "32", "--out", str(tmp_path)]) == 0
    cells = json.loads((tmp_path / "models.json").read_text())["cells"]
    by = {(c["model"], c["T"]): c for c in cells}
    assert sorted(by) == sorted((m, T) for m in ("fla-gla", "gla", "llama") for T in (16, 32))
    for key in ("gla", "llama"):
        assert by[key, 16]["status"] == "ok" and by[key, 16]["ktok_s"] > 0 and by[key, 16]["B"] == 2
        assert by[key, 32]["B"] == 1  # one sequence once T reaches the tokens per step
    if not HAS_FLA:
        assert by["fla-gla", 16]["status"] == "skipped" and by["fla-gla", 16]["reason"] == "fla not installed"
    table = (tmp_path / "models.md").read_text()
    assert "| linmem gla |" in table and "| HF Llama (SDPA) |" in table and "2 x 16" in table


def test_models_bench_modes_compile_blocks_and_name_what_cannot_graph(tmp_path):
    """Compiled rows compile each block (and report compile seconds); a CUDA graph on a CPU is a skipped cell
    with its reason; an unknown mode is refused by name."""
    assert models.main(TINY + ["--models", "transformer", "--modes", "eager,compiled,graph", "--seq-lens", "16",
                               "--tokens", "16", "--warmup", "2", "--out", str(tmp_path)]) == 0
    torch._dynamo.reset()
    by = {c["mode"]: c for c in json.loads((tmp_path / "models.json").read_text())["cells"]}
    assert by["eager"]["status"] == by["compiled"]["status"] == "ok" and by["compiled"]["compile_s"] is not None
    assert by["graph"]["status"] == "skipped" and "CUDA device" in by["graph"]["reason"]
    assert "(compiled)" in (tmp_path / "models.md").read_text()
    with pytest.raises(ValueError, match="modes: expected some of eager, compiled, graph, got fast"):
        models.TrainBenchConfig(modes=("fast",), device="cpu")
    with pytest.raises(ValueError, match="graph mode needs warmup >= 2"):
        models.TrainBenchConfig(modes=("graph",), warmup=1, device="cpu")


def test_decode_bench_times_each_cache_and_writes_tables_and_plots(tmp_path):
    assert decode.main(TINY + ["--models", "gla", "--peers", "llama", "--contexts", "8,16", "--batch", "2",
                               "--generate-contexts", "16", "--out", str(tmp_path)]) == 0
    cells = json.loads((tmp_path / "decode.json").read_text())["cells"]
    by = {(c["model"], c["cache"], c["context"]): c for c in cells}
    assert len(by) == 8  # Llama dynamic and static, linmem GLA own cache and static, at 2 contexts
    for cache in ("dynamic", "static"):
        cell = by["llama", cache, 16]
        assert cell["status"] == "ok" and cell["ms_per_token"] > 0 and cell["generate_ms_per_token"] > 0
    own = by["gla", "dynamic", 8]
    assert own["status"] == "ok" and own["prefill_ms"] > 0 and own["generate_ms_per_token"] is None
    assert by["gla", "dynamic", 16]["generate_ms_per_token"] > 0
    assert by["gla", "static", 8]["status"] in ("ok", "not available")  # probed, reported either way
    assert (tmp_path / "decode_latency.png").stat().st_size > 0 and (tmp_path / "decode_memory.png").exists()
    assert "| linmem gla |" in (tmp_path / "decode.md").read_text()


def test_out_of_memory_is_a_cell_and_ends_a_decode_row(monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(models, "_train", oom)
    config = models.TrainBenchConfig(models=("gla",), seq_lens=(16, 32), device="cpu")
    assert [c.status for c in models.run_models(config)] == ["out of memory"] * 2

    monkeypatch.setattr(decode, "_own_cache", oom)
    monkeypatch.setattr(decode, "build_model", lambda *a, **k: (torch.nn.Linear(1, 1), ""))
    config = decode.DecodeBenchConfig(models=("gla",), contexts=(8, 16, 32), device="cpu")
    cells = decode.run_decode(config)[:3]  # the own-cache row
    assert [c.status for c in cells] == ["out of memory", "not run", "not run"]
    assert cells[1].reason == "out of memory at context 8"


def test_a_spent_budget_starts_no_cell():
    config = models.TrainBenchConfig(models=("gla",), seq_lens=(16,), budget_s=0.0, device="cpu")
    (cell,) = models.run_models(config)
    assert cell.status == "not run" and "budget" in cell.reason


def test_linmem_rows_run_before_the_peers_and_the_table_keeps_each_peer_above_its_model(monkeypatch):
    ran = []
    monkeypatch.setattr(models, "train_cell", lambda key, mode, T, config: ran.append(key) or models.TrainCell(
        key, peers.model_spec(key).label, mode, 1, T))
    config = models.TrainBenchConfig(models=("deltanet", "transformer"), peers=("llama", "fla-deltanet"),
                                     seq_lens=(64,), device="cpu")
    cells = models.run_models(config)
    assert ran == ["deltanet", "transformer", "fla-deltanet", "llama"]
    assert [row[0].model for row in models._row_cells(cells, config)] == ["fla-deltanet", "deltanet", "llama",
                                                                         "transformer"]


def test_fla_gated_backward_refusal_is_read_from_flas_flags(monkeypatch):
    flags = types.ModuleType("fla.ops.common.chunk_o")
    flags.IS_NVIDIA_HOPPER, flags.TRITON_ABOVE_3_4_0, flags.TRITON_ABOVE_3_7_1 = True, True, False
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", flags)
    assert "fla issue 640" in peers.training_refusal("fla-gated_deltanet", "cuda")
    assert peers.training_refusal("fla-gla", "cuda") is None  # GLA's backward has its own kernels
    assert peers.training_refusal("fla-gated_deltanet", "cpu") is None
    flags.TRITON_ABOVE_3_7_1 = True
    assert peers.training_refusal("fla-hybrid", "cuda") is None


def test_the_default_shape_gives_models_of_about_370M_parameters():
    shape = peers.ModelShape()
    assert shape.mlp_width == 2816 and shape.hybrid_pattern == "LLLN" * 6
    counts = {}
    for key in ("llama", "transformer", "gla", "deltanet", "gated_deltanet", "hybrid", "fox"):
        model, _ = peers.build_model(key, shape, device="meta")
        counts[key] = sum(p.numel() for p in model.parameters()) / 1e6
    assert all(350 < n < 430 for n in counts.values()), counts
    assert abs(counts["transformer"] - counts["llama"]) < 1, counts  # same blocks, same MLP width


@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention not installed")
def test_each_fla_peer_has_the_parameters_of_its_linmem_model():
    """The config mapping of linmem.bench.peers gives the same parameter count on both sides (within 0.1%:
    biases and norm weights differ); fla's hybrid needs the flash-attn package and is left out."""
    shape = peers.ModelShape()
    for arch in ("gla", "deltanet", "gated_deltanet", "fox", "mom"):
        ours, theirs = (sum(p.numel() for p in peers.build_model(key, shape, device="meta")[0].parameters())
                        for key in (arch, peers.PEER_OF[arch]))
        assert abs(ours - theirs) < 1e-3 * theirs, (arch, ours, theirs)


def test_unknown_names_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="valid: transformer, gla"):
        models.TrainBenchConfig(models=("mamba9",))
    with pytest.raises(SystemExit, match="unknown peer fla-gpt"):
        decode.main(["--peers", "fla-gpt"])
    with pytest.raises(ValueError, match="ascending"):
        decode.DecodeBenchConfig(contexts=(4096, 1024))


def test_decode_bench_prunes_the_fox_rows(tmp_path):
    """--prune-tolerance builds the fox rows with mixer.prune_tolerance (their label says so); it is refused
    without fox or outside (0, 1)."""
    assert decode.main(TINY + ["--models", "fox", "--contexts", "16", "--batch", "1", "--generate-contexts", "none",
                               "--prune-tolerance", "0.01", "--out", str(tmp_path)]) == 0
    cells = json.loads((tmp_path / "decode.json").read_text())["cells"]
    own = next(c for c in cells if c["cache"] == "dynamic")
    assert own["status"] == "ok" and own["label"] == "linmem fox, pruned at 0.01"
    model, _ = peers.build_model("fox", peers.ModelShape(hidden_size=64, num_layers=1, vocab_size=128), device="meta",
                                 mixer={"prune_tolerance": 0.01})
    assert model.config.mixer["prune_tolerance"] == 0.01
    for bad in ({"models": ("gla",), "prune_tolerance": 0.01}, {"models": ("fox",), "prune_tolerance": 2.0}):
        with pytest.raises(ValueError, match="prune_tolerance prunes the fox rows"):
            decode.DecodeBenchConfig(**bad)
