"""``linmem bench layers --parts mixers``: the rows it times are built on CPU for any memory mixer by name."""

from __future__ import annotations

import pytest
import torch

from linmem.bench import BenchError
from linmem.bench.layers import add_arguments, mixer_variants
from linmem.layers import mixer_names


def test_mixer_rows_build_every_variant_and_run_on_cpu():
    rows = mixer_variants(["gated_deltanet", "ttt", "titans"], 64, 2)
    assert [label for label, _ in rows] == ["gated_deltanet", "ttt", "titans", "titans momentum=True"]
    assert rows[-1][1].state_names == ("recurrent", "momentum")
    x = torch.randn(1, 5, 64, requires_grad=True)
    for _, mixer in rows:
        mixer(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_mixer_rows_refuse_unknown_names_with_the_valid_ones():
    with pytest.raises(BenchError, match="unknown mixers \\['llama_attention'\\]; valid: all, .*titans"):
        mixer_variants(["llama_attention"], 64, 2)


def test_all_is_every_memory_mixer_and_the_attention_baselines_and_each_runs_on_cpu():
    rows = mixer_variants(["all"], 32, 2)
    labels = [label for label, _ in rows]
    assert [label for label in labels if " " not in label] == [*mixer_names("memory"), "softmax", "fox"]
    x = torch.randn(1, 5, 32, requires_grad=True)
    for label, mixer in rows:
        mixer(x).sum().backward()
        assert torch.isfinite(x.grad).all(), label


def test_the_mixers_part_and_its_default_list_are_options():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--parts", "mixers"])
    assert args.mixers.split(",") == ["gla", "mamba2", "gfw", "gateloop", "mamba", "s4", "gated_deltanet", "ttt",
                                      "titans"]
    assert parser.parse_args(["--mixer-seq-lens", "2048,4096"]).mixer_seq_lens == "2048,4096"
