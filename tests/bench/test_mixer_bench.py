"""``linmem bench layers --parts mixers``: the rows it times are built on CPU for any memory mixer by name."""

from __future__ import annotations

import pytest
import torch

from linmem.bench import BenchError
from linmem.bench.layers import add_arguments, mixer_variants


def test_mixer_rows_build_every_variant_and_run_on_cpu():
    rows = mixer_variants(["gated_deltanet", "ttt", "titans"], 64, 2)
    assert [label for label, _ in rows] == ["gated_deltanet", "ttt", "titans", "titans momentum=True"]
    assert rows[-1][1].state_names == ("recurrent", "momentum")
    x = torch.randn(1, 5, 64, requires_grad=True)
    for _, mixer in rows:
        mixer(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_mixer_rows_refuse_unknown_names_with_the_valid_ones():
    with pytest.raises(BenchError, match="unknown memory mixers \\['softmax'\\]; valid: .*titans"):
        mixer_variants(["softmax"], 64, 2)


def test_the_mixers_part_and_its_default_list_are_options():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--parts", "mixers"])
    assert args.mixers.split(",") == ["gla", "mamba2", "gfw", "gateloop", "mamba", "s4", "gated_deltanet", "ttt",
                                      "titans"]
