"""transformers' own generic tests run against LinmemModel and LinmemForCausalLM: ModelTesterMixin,
GenerationTesterMixin and ConfigTester from the source of the installed transformers
(:mod:`tests.models.transformers_tests` says where it comes from; without it the module skips with the reason).

The tiny model has one memory layer and one softmax attention layer (``layer_pattern="LN"``), the two kinds of
layer a hybrid mixes. The tests a recurrent model cannot pass are skipped below, each with its reason, as
transformers' own Mamba and RecurrentGemma tests do.
"""

from __future__ import annotations

import unittest
from unittest import mock

import pytest
import torch

from linmem.models import LinmemConfig, LinmemForCausalLM, LinmemModel
from tests.models.transformers_tests import SourcesUnavailable, load_transformers_tests

try:
    SOURCES = load_transformers_tests()
except SourcesUnavailable as err:
    pytest.skip(str(err), allow_module_level=True)

common = SOURCES.modeling


class LinmemModelTester:
    """Builds the tiny config and inputs the mixins ask for (the attributes they read: batch_size, seq_length, ...)."""

    def __init__(self, parent: unittest.TestCase, batch_size: int = 2, seq_length: int = 7, vocab_size: int = 99,
                 hidden_size: int = 32, num_attention_heads: int = 2, layer_pattern: str = "LN") -> None:
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.layer_pattern = layer_pattern
        self.num_hidden_layers = len(layer_pattern)
        self.is_training = True
        self.pad_token_id = 0

    def get_config(self) -> LinmemConfig:
        return LinmemConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                            num_heads=self.num_attention_heads, layer_pattern=self.layer_pattern,
                            intermediate_size=64, pad_token_id=self.pad_token_id)

    def prepare_config_and_inputs_for_common(self) -> tuple[LinmemConfig, dict]:
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        return self.get_config(), {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _register_in_transformers_tables(test_class: type) -> None:
    """The mixins tell a base model from a causal LM by transformers' own name tables, which list the models inside
    transformers only: add linmem's for the duration of the test class."""
    from transformers.models.auto import modeling_auto

    for table, model in ((modeling_auto.MODEL_MAPPING_NAMES, LinmemModel),
                         (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, LinmemForCausalLM)):
        patch = mock.patch.dict(table, {LinmemConfig.model_type: model.__name__})
        patch.start()
        test_class.addClassCleanup(patch.stop)


class LinmemGenericTest(common.ModelTesterMixin, SOURCES.generation_mixin, unittest.TestCase):
    all_model_classes = (LinmemModel, LinmemForCausalLM)
    has_attentions = False  # no attention weights: output_attentions=True is refused by name

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        _register_in_transformers_tables(cls)

    def setUp(self) -> None:
        self.model_tester = LinmemModelTester(self)
        self.config_tester = SOURCES.configuration.ConfigTester(
            self, config_class=LinmemConfig, hidden_size=32, num_heads=2, layer_pattern="LN",
            common_properties=["hidden_size", "num_hidden_layers"])

    def test_config(self) -> None:
        """Every check of ConfigTester but that of the common keywords (its own test below)."""
        with mock.patch.object(self.config_tester, "check_config_arguments_init"):
            self.config_tester.run_common_tests()

    def test_config_arguments_init(self) -> None:
        """Every common PretrainedConfig keyword (use_cache, return_dict, output_hidden_states, token ids, ...)
        is kept by LinmemConfig."""
        reason = SOURCES.skip_reason("utils/test_configuration_utils.py")
        if reason:
            self.skipTest(reason)
        self.config_tester.check_config_arguments_init()
