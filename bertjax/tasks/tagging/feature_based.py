r"""The feature-based approach (paper Sec. 5.3, Table 7): BERT frozen, its layer outputs cached
once per dataset, a two-layer bidirectional LSTM and a classifier trained on them. A ModernBERT
checkpoint works the same way (its layers as `bertjax.models.heads.hidden_states` gives them,
the last one final-normed; the BiLSTM's dropout its mlp_dropout).

  python -m bertjax.finetune --config=experiments/ner_feature_based.py:concat_last_four \
      --config.init_checkpoint=checkpoints/bert-base-cased --config.data.dir=conll2003 ...
  python -m bertjax.finetune_grid --config=experiments/ner_feature_based.py --seeds=1 \
      --grid='feature_based.variant=embeddings,last,...' --config.feature_based.cache_layers=all
      # all six variants, the encoder run once for all, then the table (workdir/summary.md)

How it sits on the core: config.task.family = feature_based (token classification's data and
features, another model: `FeatureBasedTagger`, bertjax/models/tagging.py); `initial_params`
keeps the pre-trained encoder for the task and loads nothing into the trained model, whose
params are only {"lstm_<layer>_forward" / "_backward", "classifier", and for weighted sums
"layer_weights", "layer_scale"}: the optimizer cannot touch the encoder, and the training loop
never runs it.
`encode` builds the same rows as fine-tuning (first sub-token labels, windows, document
context), runs the encoder over them ONCE and writes each needed layer's vectors of the rows'
own-sentence pieces to a memory-mapped cache (`<cache_dir>/<fingerprint>/layer<i>.npy`,
[tokens, hidden]); later epochs, runs and variants read the cache. The BiLSTM reads the
sentence's own pieces (their vectors were computed with the document context around them), and
the classifier scores each word's first sub-token as in fine-tuning.

Variants (hidden_states index: 0 = embedding output, i = output of encoder layer i, L = last):
  embeddings [0]; second_to_last [L-1]; last [L]; weighted_sum_last_four [L-3..L];
  concat_last_four [L-3..L] (the paper's best, 96.1 dev F1 at BERT-base); weighted_sum_all
  [0..L]. Weighted sums are softmax-normalised learned scalars times a learned scale (ELMo's
  scalar mix).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from bertjax.errors import ConfigError, DataError
from bertjax.models import heads
from bertjax.models.tagging import FeatureBasedTagger
from bertjax.tasks.base import unexportable
from bertjax.tasks.tagging import features as token_features
from bertjax.tasks.tagging.task import TokenClassificationTask
from data_pipeline import finetune_data

VARIANTS = ("embeddings", "second_to_last", "last", "weighted_sum_last_four",
            "concat_last_four", "weighted_sum_all")


def variant_layers(variant: str, num_layers: int) -> tuple[list[int], str]:
    """(hidden_states indices, combination: single | weighted | concat) of a Table 7 row."""
    last = num_layers
    four = list(range(last - 3, last + 1))
    table = {"embeddings": ([0], "single"), "second_to_last": ([last - 1], "single"),
             "last": ([last], "single"), "weighted_sum_last_four": (four, "weighted"),
             "concat_last_four": (four, "concat"),
             "weighted_sum_all": (list(range(last + 1)), "weighted")}
    if variant not in table:
        raise ConfigError(f"config.feature_based.variant={variant!r} is not one of "
                          f"{' | '.join(VARIANTS)}")
    layers, mode = table[variant]
    if min(layers) < 0:
        raise ConfigError(f"config.feature_based.variant={variant} needs 4 encoder layers; the "
                          f"model has {num_layers}")
    return layers, mode


# ---------------------------------------------------------------------------------------------
# The cache


def fingerprint(encoder, model_config, rows, extra: dict) -> str:
    """Hash of everything the cached vectors depend on: the encoder's values, its config, the
    rows' token ids and the settings in `extra`."""
    h = hashlib.blake2b(digest_size=16)
    for leaf in jax.tree.leaves(encoder):
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    h.update(json.dumps({"config": str(model_config), **extra}, sort_keys=True).encode())
    for row in rows:
        h.update(np.asarray(row, np.int32).tobytes() + b"|")
    return h.hexdigest()


class FeatureCache:
    """Per-layer memory-mapped arrays [tokens, hidden] of one dataset's rows' own pieces
    (row r at offsets[r]:offsets[r + 1]). A layer file appears only when complete (written
    under a temporary name, then renamed)."""

    def __init__(self, directory: str, key: str, lengths: np.ndarray, hidden: int, dtype: str):
        self.directory = epath.Path(directory) / key
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.hidden, self.dtype = hidden, np.dtype(dtype)
        self._open: dict[int, np.ndarray] = {}

    def path(self, layer: int) -> epath.Path:
        return self.directory / f"layer{layer}.npy"

    def missing(self, layers) -> list[int]:
        return [i for i in layers if not self.path(i).exists()]

    def write(self, compute_rows, layers: list[int]) -> None:
        """compute_rows() yields (row indices, vectors [n_layers, rows, seq, hidden]) covering
        every row once; writes the layers' files."""
        self.directory.mkdir(parents=True, exist_ok=True)
        total = int(self.offsets[-1])
        tmp = {i: str(self.path(i)) + f".tmp{os.getpid()}.npy" for i in layers}
        arrays = {i: np.lib.format.open_memmap(tmp[i], mode="w+", dtype=self.dtype,
                                               shape=(total, self.hidden)) for i in layers}
        for rows, spans, vectors in compute_rows():
            for k, i in enumerate(layers):
                for j, (r, (lo, hi)) in enumerate(zip(rows, spans)):
                    arrays[i][self.offsets[r]:self.offsets[r + 1]] = vectors[k, j, lo:hi]
        for i in layers:
            arrays[i].flush()
            del arrays[i]
            os.replace(tmp[i], self.path(i))

    def read(self, layer: int, row: int) -> np.ndarray:
        """[len_row, hidden] (memory-mapped)."""
        if layer not in self._open:
            self._open[layer] = np.load(self.path(layer), mmap_mode="r")
        return self._open[layer][self.offsets[row]:self.offsets[row + 1]]


# ---------------------------------------------------------------------------------------------
# The task


class FeatureBasedTask(TokenClassificationTask):
    """Token classification on cached frozen-BERT features (config.feature_based)."""

    packed_kinds = ()  # its BiLSTM would run from one packed example into the next

    def __init__(self, config):
        super().__init__(config)
        self.fb = config.feature_based
        self.encoder_batches = 0  # encoder passes run by this task (a test counts them)
        self.encode_seconds = 0.0

    def initial_params(self, model_config, pretrained):
        # The trained model has no encoder: keep it here to compute the cache, load nothing.
        self.model_config = model_config
        self._encoder = (None if pretrained is None  # no checkpoint (a dry run, a test)
                         else pretrained[heads.encoder_name(model_config)])
        self.layers, self.mode = variant_layers(self.fb.variant, model_config.num_layers)
        return {}

    def encode(self, tokenizer, examples, max_seq_length: int):
        rows = super().encode(tokenizer, examples, max_seq_length)
        own = rows.own
        lengths = own[:, 1] - own[:, 0]
        key = fingerprint(self._encoder, self.model_config, rows.input_ids,
                          {"dtype": self.fb.cache_dtype})
        cache = FeatureCache(self.fb.cache_dir or default_cache_dir(), key, lengths,
                             self.model_config.hidden_size, self.fb.cache_dtype)
        # Compute every layer the variants may want in the one pass: later variants reuse it.
        wanted = sorted(set(self.layers) | set(self._cache_layers()))
        missing = cache.missing(wanted)
        if missing:
            start = time.perf_counter()
            cache.write(lambda: self._run_encoder(rows, missing, max_seq_length), missing)
            self.encode_seconds += time.perf_counter() - start
        features = token_features.TokenFeatures(
            [r[lo:hi] for r, (lo, hi) in zip(rows.input_ids, own)],
            [r[lo:hi] for r, (lo, hi) in zip(rows.word_index, own)],
            [r[lo:hi] for r, (lo, hi) in zip(rows.label_ids, own)],
            rows.sentence, rows.num_words, np.stack([np.zeros_like(lengths), lengths], -1))
        features.cache = cache
        self._features[id(examples)] = features
        return features

    def _cache_layers(self) -> list[int]:
        spec = self.fb.cache_layers
        if spec == "all":
            return list(range(self.model_config.num_layers + 1))
        return [int(x) % (self.model_config.num_layers + 1) for x in spec.split(",") if x]

    def _run_encoder(self, rows, layers: list[int], max_seq_length: int):
        """Yields (row indices, own spans, [n_layers, batch, seq, hidden]) for every row."""
        if self._encoder is None:
            raise DataError("the encoder was released before every split was cached")
        index = jnp.asarray(layers)

        @jax.jit
        def run(params, ids, segments, mask):
            states = heads.hidden_states(self.model_config, params, ids, segments, mask)
            return states[index].astype(jnp.float32)

        params = jax.device_put(self._encoder)
        for batch in token_features.batches(rows, self.fb.encode_batch_size, self.buckets,
                                            shuffle=False):
            keep = batch["example_index"] >= 0
            vectors = np.asarray(run(params, batch["input_ids"], batch["segment_ids"],
                                     batch["input_mask"]))
            self.encoder_batches += 1
            indices = batch["example_index"][keep]
            yield indices, rows.own[indices], vectors[:, keep]

    def describe(self, features) -> str:
        return (super().describe(features) + f"; feature-based {self.fb.variant} (cache "
                f"{features.cache.directory}, encoder {self.encode_seconds:.1f}s)")

    def batches(self, features, batch_size: int, *, shuffle: bool, seed: int = 0):
        # Evaluation batches group rows by length (less padding; their order does not matter).
        grouped = self.group_by_length or not shuffle
        for length, indices in finetune_data.plan_batches(features, batch_size, self.buckets,
                                                          shuffle=shuffle, seed=seed,
                                                          group_by_length=grouped):
            yield self._batch(features, length, indices, batch_size)

    def _batch(self, features, length: int, indices, batch_size: int) -> dict[str, np.ndarray]:
        base = token_features.make_batch(features, length, indices, batch_size,
                                         jax.process_index(), jax.process_count())
        rows = base["example_index"]
        vectors = np.zeros((len(rows), length, len(self.layers), self.model_config.hidden_size),
                           np.float32)
        for j, r in enumerate(rows):
            if r >= 0:
                for k, layer in enumerate(self.layers):
                    values = features.cache.read(layer, r)
                    vectors[j, :len(values), k] = values
        del base["input_ids"], base["segment_ids"]
        base["features"] = vectors
        return base

    def batch_spec(self, batch_size: int, max_seq_length: int):
        spec = super().batch_spec(batch_size, max_seq_length)
        del spec["input_ids"], spec["segment_ids"]
        spec["features"] = jax.ShapeDtypeStruct(
            (batch_size, max_seq_length, len(self.layers), self.model_config.hidden_size),
            jnp.float32)
        return spec

    def hf_head(self):
        return unexportable("the feature-based tagger reads frozen layers into its own BiLSTM; "
                            "it has no Hugging Face BERT class")

    def model(self, model_config):
        self._encoder = None  # every split is cached by now: host memory back
        return FeatureBasedTagger(len(self.labels), len(self.layers), self.mode,
                                  self.fb.lstm_units, self.fb.lstm_layers,
                                  heads.head_dropout(model_config, None),
                                  model_config.initializer_range)

    def init_inputs(self) -> tuple:
        return (jnp.zeros((1, 8, len(self.layers), self.model_config.hidden_size), jnp.float32),
                jnp.ones((1, 8), jnp.int32))

    def outputs(self, model, params, batch, **kwargs):
        return model.apply({"params": params}, batch["features"], batch["input_mask"], **kwargs)


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "bertjax", "features")
