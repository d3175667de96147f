"""Data: what models read, below training and evaluation.

* :mod:`~linmem.data.config`: the ``data`` section of a training config (no torch).
* :mod:`~linmem.data.sources`: local text files, the standard library's sources, local datasets.
* :mod:`~linmem.data.codec`: text <-> token ids (:class:`~linmem.data.codec.Codec`: bytes or a tokenizer).
* :mod:`~linmem.data.corpus`: a text run's documents, their training / validation split, their tokens.
* :mod:`~linmem.data.prepared`: corpora tokenized once into memory-mapped shards (``linmem data prepare``).
* :mod:`~linmem.data.batches`: batch sources: fixed-size examples, packed documents; resumable.
* :mod:`~linmem.data.instruct`: instruction records, prompt-masked and packed.
* :mod:`~linmem.data.mqar`, :mod:`~linmem.data.mqar_variants`: the synthetic recall tasks' examples.

Importing ``linmem.data`` imports nothing else; each module loads when it is imported.
"""
