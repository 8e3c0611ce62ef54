"""EmbeddingTask: sentence embeddings fine-tuned contrastively or on scored pairs, one task
family of the fine-tuning plug-in (tasks/base.py).

config.task.kind:
  pairs   rows of texts in config.data.columns: anchor, positive, then hard negatives; the
          in-batch-negatives loss (losses.in_batch_loss) over the whole global batch
  scored  pairs with a score (config.data.text_a, text_b, score); CoSENT (default) or the
          cosine's squared error (config.task.loss=cosine, scores in [-1, 1])
Dev sets: scored pairs (config.data.validation: STS Spearman / Pearson of the cosine) and/or a
BEIR directory (config.data.beir: nDCG@10, MRR@10, Recall@1/10/100 by exact search over the
whole corpus). The vectors are bertjax/models/embedding.py's: pooling and normalisation from
config.task (auto: the init checkpoint's pooling.json, else mean pooling, not normalised).
Texts get their prompts (config.task.prompt / query_prompt / document_prompt, auto: the init
checkpoint's own) and lower-casing as sentence-transformers gives them (prompts.py); a pooling
with include_prompt false pools each text from the first token after its prompt (pool_from).
config.data.pack: training batches of the same rows with their texts packed several to a row
(packed.py), the same vectors and losses; evaluation is unpacked.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import checkpoint_dir, paths
from bertjax.errors import ConfigError, DataError
from bertjax.models.embedding import BertForEmbedding, Pooling, Prompts
from bertjax.tasks.base import Splits, Task, hf_head
from bertjax.tasks.embedding import losses, packed
from bertjax.tasks.embedding import metrics as metrics_lib
from bertjax.tasks.embedding import prompts as prompts_lib
from bertjax.tasks.embedding.cached import cached_vectors
from bertjax.tasks.embedding.readers import RetrievalSet, TextsExample, read_beir, read_texts
from data_pipeline import finetune_data

Array = jax.Array

KINDS = ("pairs", "scored")
LOSSES = {"pairs": ("in_batch",), "scored": ("cosent", "cosine")}
STS_METRICS = ("spearman", "pearson")
# The model's inputs of a batch: unpacked rows; packed rows (packed.py) and their texts' slots,
# whose leading axis, the batch's rows, comes last.
PADDED_KEYS = ("input_ids", "segment_ids", "input_mask")
PACKED_KEYS = PADDED_KEYS + ("packing_ids", "example_starts", "text_slots")
RETRIEVAL_METRICS = metrics_lib.RETRIEVAL_METRICS


class RetrievalExamples(list):
    """The texts of a retrieval set to embed, queries first, then the corpus (one column
    each), with the query and document prompts of `prompts`; `retrieval` keeps the ids and
    qrels the metrics need."""

    def __init__(self, retrieval: RetrievalSet, prompts: Prompts):
        # guid "DIR:query ID": warnings name the directory (data_pipeline.finetune_data).
        where = retrieval.directory or "retrieval set"
        query, document = (prompts.text(role=role) for role in ("query", "document"))
        super().__init__(
            [TextsExample(f"{where}:query {q}", (query + t,), None, q, (query,))
             for q, t in retrieval.queries.items()]
            + [TextsExample(f"{where}:document {d}", (document + t,), None, d, (document,))
               for d, t in retrieval.corpus.items()])
        self.retrieval = retrieval


class EmbeddingFeatures(finetune_data.Features):
    """Features of texts in columns (`Features` with `multiple_choice` rows: [columns, 3,
    length]); labels hold the scores (0 without); `retrieval`: the set, for retrieval dev."""

    retrieval: RetrievalSet | None = None
    keys: list | None = None  # text_keys, for batches without duplicates
    text_lengths: np.ndarray | None = None  # packed.text_lengths, for packed batches
    pool_from: np.ndarray | None = None  # [examples, columns]: prompt_positions, or None
    epoch_rows: tuple | None = None  # (batch size, EmbeddingTask.epoch_rows)


def text_keys(features) -> list[frozenset]:
    """Per row, the set of its texts (token ids) — kept on the features, computed once."""
    if getattr(features, "keys", None) is None:
        features.keys = [frozenset(row[c, 0, :int(row[c, 2].sum())].tobytes()
                                   for c in range(row.shape[0]))
                         for row in features.sequences]
    return features.keys


def no_duplicate_groups(keys: list[frozenset], batch_size: int, rng: np.random.Generator
                        ) -> list[np.ndarray]:
    """One epoch's training batches (row indices) in a random order, no text twice in a
    batch (sentence-transformers' NO_DUPLICATES sampler): a row whose text is already in the
    batch waits at the head of the queue for the next one. A batch is cut short only where
    the rows left all repeat one of its texts."""
    queue = collections.deque(rng.permutation(len(keys)).tolist())
    groups = []
    while queue:
        rows, seen, waiting = [], set(), []
        while queue and len(rows) < batch_size:
            i = queue.popleft()
            if keys[i] & seen:
                waiting.append(i)
            else:
                rows.append(i)
                seen |= keys[i]
        queue.extendleft(reversed(waiting))
        groups.append(np.array(rows, np.int64))
    return groups


def matryoshka_dims(text: str) -> tuple[int, ...]:
    """config.task.matryoshka_dims "768,256,64" → (768, 256, 64), largest first."""
    try:
        dims = {int(d) for d in text.split(",") if d.strip()}
    except ValueError:
        dims = {0}
    if any(d < 1 for d in dims):
        raise ConfigError(f"config.task.matryoshka_dims={text!r}: give positive sizes, e.g. "
                          "768,512,256,128,64")
    return tuple(sorted(dims, reverse=True))


def _flag(value, name: str) -> bool | None:
    """config strings "auto" | "true" | "false" (None: auto)."""
    text = str(value).lower()
    if text not in ("auto", "true", "false"):
        raise ConfigError(f"{name}={value!r} is not one of auto | true | false")
    return None if text == "auto" else text == "true"


def pooling_of(config) -> Pooling:
    """config.task.pooling / normalize, "auto" taken from the init checkpoint's pooling.json
    (a converted sentence-transformers model), else mean pooling, not normalised."""
    stored = checkpoint_dir.load_pooling(config.init_checkpoint) if config.init_checkpoint \
        else None
    stored = stored or Pooling()
    mode = config.task.pooling
    normalize = _flag(config.task.normalize, "config.task.normalize")
    return Pooling(stored.mode if mode == "auto" else mode,
                   stored.normalize if normalize is None else normalize, stored.include_prompt)


def prompt_positions(tokenizer, examples, lower_case: bool, max_seq_length: int) -> np.ndarray:
    """[examples, columns] int32: the positions each text's prompt takes, [CLS] included (0
    for none): where sentence-transformers' include_prompt=false pooling starts, the prompt
    tokenized alone without its closing [SEP]."""
    prompts = sorted({p for e in examples for p in e.prompts if p})
    encodings = tokenizer.encode_batch(prompts_lib.lower(prompts, lower_case), None,
                                       max_seq_length=max_seq_length) if prompts else []
    taken = {p: int(sum(enc.input_mask)) - 1 for p, enc in zip(prompts, encodings)}
    taken[""] = 0
    columns = len(examples[0].texts)
    return np.array([[taken[p] for p in (e.prompts or ("",) * columns)] for e in examples],
                    np.int32)


def with_pool_from(features):
    """A batch → the same with pool_from [rows, columns] of its examples (0 for filler rows)
    where the features have it."""
    def add(batch):
        if features.pool_from is not None:
            index = batch["example_index"]
            batch["pool_from"] = np.where(index[:, None] >= 0,
                                          features.pool_from[np.maximum(index, 0)], 0)
        return batch
    return add


class EmbeddingTask(Task):
    """config.task.family: embedding (config.task.kind: pairs | scored)."""

    primary_metric = "spearman"
    packed_kinds = KINDS  # packing changes the layout only: every loss sees the same vectors

    def __init__(self, config):
        super().__init__(config)
        self.kind = config.task.kind
        if self.kind not in KINDS:
            raise ConfigError(f"config.task.kind={self.kind!r} is not one of "
                              f"{' | '.join(KINDS)}")
        self.loss_name = config.task.loss
        if self.loss_name == "auto":
            self.loss_name = LOSSES[self.kind][0]
        if self.loss_name not in LOSSES[self.kind]:
            raise ConfigError(f"config.task.loss={self.loss_name!r}: a {self.kind} task trains "
                              f"with {' | '.join(LOSSES[self.kind])}")
        self.scale = float(config.task.scale)
        self.symmetric = bool(config.task.symmetric)
        self.group_by_length = bool(config.train.get("group_by_length", False))
        # No text twice in a training batch: a passage of several anchors would otherwise be
        # the false negative of its own copies.
        self.no_duplicates = self.kind == "pairs" and bool(config.task.get("no_duplicates",
                                                                            True))
        self.pooling = pooling_of(config)
        self.prompts = prompts_lib.prompts_of(config)
        self.lower_case = prompts_lib.lower_case_of(config)
        self.columns = 2
        self.matryoshka_dims = matryoshka_dims(str(config.task.get("matryoshka_dims", "")))
        # GradCache: a training batch encoded this many rows at a time (0: all at once).
        self.cache_chunk_rows = int(config.task.get("cache_chunk_rows", 0))
        self.grad_accum_steps = int(config.train.get("grad_accum_steps", 1))
        # config.data.pack: training texts packed several to a row (packed.py; what it cannot
        # take is refused by tasks/checks.py, `packing_refusal`).
        self.pack = bool((config.get("data") or {}).get("pack", False))
        batch = self.train_batch_size = int(config.train.get("batch_size", 0))
        if self.cache_chunk_rows and (self.cache_chunk_rows < 0 or batch % self.cache_chunk_rows):
            raise ConfigError(f"config.task.cache_chunk_rows={self.cache_chunk_rows} must divide "
                              f"config.train.batch_size={batch}")

    # ---- data

    def read(self, config) -> Splits:
        data = config.data
        encoding = data.get("encoding") or paths.DEFAULT_ENCODING
        if not data.train:
            raise ConfigError("config.data.train is empty")
        if not data.validation and not data.beir:
            raise ConfigError("give a dev set: config.data.validation (scored pairs: STS "
                              "metrics) and/or config.data.beir (a BEIR directory: retrieval "
                              "metrics)")
        scored_columns = (data.text_a, data.text_b)
        if self.kind == "pairs":
            columns = tuple(c.strip() for c in data.columns.split(",") if c.strip())
            if len(columns) < 2:
                raise ConfigError(f"config.data.columns={data.columns!r}: name the anchor and "
                                  "positive columns (then any hard negatives), e.g. "
                                  "query,passage")
            train = read_texts(data.train, columns, field="columns", encoding=encoding)
        else:
            train = read_texts(data.train, scored_columns, score=data.score, field="text_a",
                               encoding=encoding)
        self.columns = len(train[0].texts)
        train = prompts_lib.with_prompts(train, self.column_prompts(self.kind, self.columns))
        dev = {}
        if data.validation:
            dev["sts"] = prompts_lib.with_prompts(
                read_texts(data.validation, scored_columns, score=data.score, field="text_a",
                           encoding=encoding), self.column_prompts("scored", 2))
        if data.beir:
            dev["retrieval"] = RetrievalExamples(read_beir(data.beir, data.beir_split, encoding),
                                                 self.prompts)
        names = (STS_METRICS if "sts" in dev else ()) + (
            RETRIEVAL_METRICS if "retrieval" in dev else ())
        prefixed = len(dev) > 1  # FineTuningJob prefixes each dev set's metrics then
        self.metric_names = tuple(
            (f"{'sts' if m in STS_METRICS else 'retrieval'}_{m}" if prefixed else m)
            for m in names)
        self.primary_metric = self.metric_names[len(STS_METRICS) if prefixed else 0]
        return Splits(train, dev, {})

    def column_prompts(self, kind: str, columns: int) -> tuple[str, ...]:
        return prompts_lib.column_prompts(self.prompts, kind, columns)

    def encode(self, tokenizer, examples, max_seq_length: int) -> EmbeddingFeatures:
        """Each text as `[CLS] text [SEP]` on its own (lower-cased first where the model
        says so); a row's columns padded to its longest."""
        if not examples:
            raise DataError("no examples to encode")
        self.buckets = self.bucket_lengths(max_seq_length)
        k = len(examples[0].texts)
        texts = prompts_lib.lower([t for e in examples for t in e.texts], self.lower_case)
        encodings = tokenizer.encode_batch(texts, None, max_seq_length=max_seq_length)
        sequences = [finetune_data.stack_encodings(encodings[i * k:(i + 1) * k])
                     for i in range(len(examples))]
        truncated = finetune_data.count_truncated(encodings, texts, [None] * len(texts), k)
        scores = np.array([0.0 if e.score is None else e.score for e in examples], np.float32)
        features = EmbeddingFeatures(sequences, scores, True, truncated)
        features.retrieval = getattr(examples, "retrieval", None)
        if not self.pooling.include_prompt:
            features.pool_from = prompt_positions(tokenizer, examples, self.lower_case,
                                                  max_seq_length)
        finetune_data.warn_truncated(features, examples, max_seq_length)
        return features

    @classmethod
    def packing_refusal(cls, config, model) -> str | None:
        """What of `config` packed batches do not take: a batch split over data-parallel
        replicas apart (bfloat16 gradient sums; the texts' slots count within the batch's
        groups of rows), cls pooling of a causal BERT (its pooled token is each text's last)."""
        if (config.get("train") or {}).get("grad_reduce_dtype") == "bfloat16":
            return "config.train.grad_reduce_dtype='bfloat16'"
        pooling = pooling_of(config)
        if getattr(model, "causal", False) and pooling.mode == "cls":
            return "cls pooling of a causal (left-to-right) BERT"
        if not pooling.include_prompt:
            return "a pooling that leaves the prompt out (the init checkpoint's include_prompt)"
        return None

    def packing_groups(self, batch_size: int) -> int:
        """The parts a training step encodes a batch in, each packed in its own rows
        (packed.place): the micro-batches of config.train.grad_accum_steps, each in the
        chunks of config.task.cache_chunk_rows (in `outputs`)."""
        micro = batch_size // self.grad_accum_steps
        chunks = micro // self.cache_chunk_rows if self.cache_chunk_rows else 1
        return self.grad_accum_steps * max(chunks, 1)

    def train_plan(self, features, batch_size: int, seed: int
                   ) -> list[tuple[int, np.ndarray]]:
        """One epoch's training batches, (padded length, row indices) each: packed or not, the
        same rows in the same order."""
        if not self.no_duplicates:
            return finetune_data.plan_batches(features, batch_size, self.buckets, shuffle=True,
                                              seed=seed, group_by_length=self.group_by_length)
        grid = finetune_data.prediction_buckets(self.buckets)
        lengths = features.lengths
        groups = no_duplicate_groups(text_keys(features), batch_size,
                                     np.random.default_rng(seed))
        return [(grid[finetune_data.assign_buckets(lengths[rows].max(keepdims=True), grid)[0]],
                 rows) for rows in groups]

    def text_packing(self, features, batch_size: int) -> packed.TextPacking:
        return packed.text_packing(features, self.buckets, batch_size, jax.device_count())

    def batches(self, features, batch_size: int, *, shuffle: bool, seed: int = 0):
        where = dict(process_index=jax.process_index(), process_count=jax.process_count())
        if not shuffle:
            return map(with_pool_from(features), finetune_data.batches(
                features, batch_size, self.buckets, shuffle=False, **where))
        plan = self.train_plan(features, batch_size, seed)
        if self.pack:
            packing = self.text_packing(features, batch_size)
            groups = self.packing_groups(batch_size)
            return (packed.make_batch(features, rows, batch_size, packing, groups, **where)
                    for _, rows in plan)
        return (with_pool_from(features)(finetune_data.make_batch(features, length, rows,
                                                                  batch_size, **where))
                for length, rows in plan)

    def epoch_rows(self, features, batch_size: int) -> list[int]:
        """Rows of each packed batch of the epoch of seed 0, for the log line and the batch
        spec (kept on the features: an epoch's first fit is seconds for 100,000 rows)."""
        if features.epoch_rows is None or features.epoch_rows[0] != batch_size:
            packing = self.text_packing(features, batch_size)
            groups = self.packing_groups(batch_size)
            features.epoch_rows = (batch_size, [
                packed.batch_rows(features, rows, packing, groups)
                for _, rows in self.train_plan(features, batch_size, 0)])
        return features.epoch_rows[1]

    def num_batches(self, features, batch_size: int) -> int:
        return len(self.train_plan(features, batch_size, 0))

    def train_batch_spec(self, features, batch_size: int, max_seq_length: int):
        """Unpacked: `batch_spec`; packed: the most rows of an epoch (seed 0)."""
        spec = self.batch_spec(batch_size, max_seq_length)
        if not self.pack:
            return spec
        packing = self.text_packing(features, batch_size)
        rows = max(self.epoch_rows(features, batch_size))
        i32 = jnp.int32
        tokens = jax.ShapeDtypeStruct((rows, packing.length), i32)
        return {**spec, **{k: tokens for k in packed.TOKEN_KEYS},
                "example_starts": jax.ShapeDtypeStruct((rows, packing.slots), i32),
                "text_slots": jax.ShapeDtypeStruct((batch_size, self.columns), i32)}

    def batch_spec(self, batch_size: int, max_seq_length: int):
        tokens = jax.ShapeDtypeStruct((batch_size, self.columns, max_seq_length), jnp.int32)
        rows = lambda dtype: jax.ShapeDtypeStruct((batch_size,), dtype)  # noqa: E731
        spec = {"input_ids": tokens, "segment_ids": tokens, "input_mask": tokens,
                "labels": rows(jnp.float32), "weights": rows(jnp.float32),
                "example_index": rows(jnp.int32)}
        if not self.pooling.include_prompt:
            spec["pool_from"] = jax.ShapeDtypeStruct((batch_size, self.columns), jnp.int32)
        return spec

    def describe(self, features) -> str:
        prompts = self.column_prompts(self.kind, self.columns)
        batch = self.train_batch_size
        packing = (packed.describe(features, self.train_plan(features, batch, 0), batch,
                                   self.text_packing(features, batch).length,
                                   self.epoch_rows(features, batch)) if self.pack else "")
        return (f"; {self.columns} text(s) a row, {self.pooling.mode} pooling"
                f"{', normalised' if self.pooling.normalize else ''}, loss {self.loss_name}"
                f"{f', prompts {prompts}' if any(prompts) else ''}"
                f"{' (not pooled)' if any(prompts) and not self.pooling.include_prompt else ''}"
                f"{', lower-cased' if self.lower_case else ''}{packing}")

    # ---- model and loss

    pretrained_head = False  # the vectors pool the encoder's output: no prediction head

    def model(self, model_config):
        return BertForEmbedding(model_config, self.pooling)

    def init_inputs(self) -> tuple:
        ids = jnp.zeros((1, self.columns, 8), jnp.int32)
        return ids, ids, ids

    def outputs(self, model, params, batch, **kwargs):
        """[batch, columns, hidden]; packed rows (packed.py) pooled per text and gathered
        back into the columns; in training with config.task.cache_chunk_rows, encoded a chunk
        at a time with the whole batch's gradients (cached.py)."""
        keys = PACKED_KEYS if "packing_ids" in batch else PADDED_KEYS + (
            ("pool_from",) if "pool_from" in batch else ())
        rows = batch[keys[-1]].shape[0]  # the batch's (a micro-batch's) rows of texts
        cached = "rngs" in kwargs and self.cache_chunk_rows and rows > self.cache_chunk_rows
        chunks = rows // self.cache_chunk_rows if cached else 1
        groups = {}
        if "packing_ids" in batch:  # the packing groups of a chunk (packed.place)
            per_group = self.train_batch_size // self.packing_groups(self.train_batch_size)
            groups = {"packing_groups": rows // chunks // per_group}
        if chunks == 1:
            return super().outputs(model, params, batch, **{k: batch[k] for k in keys[3:]},
                                   **groups, **kwargs)

        def encode(params, ids, segments, mask, *packing_and_key):
            *packing, key = packing_and_key
            return model.apply({"params": params}, ids, segments, mask,
                               **dict(zip(keys[3:], packing)), **groups, deterministic=False,
                               rngs={"dropout": key})

        return cached_vectors(encode, params, tuple(batch[k] for k in keys),
                              kwargs["rngs"]["dropout"], chunks)

    def loss(self, vectors, batch, denominators=None):
        """vectors [batch, columns, hidden] float32. With config.task.matryoshka_dims, the sum
        of the loss of each leading slice of the vectors (Matryoshka representation learning,
        as sentence-transformers' MatryoshkaLoss with unit weights); metrics of the full
        vectors."""
        if not self.matryoshka_dims:
            return self._loss(vectors, batch, denominators)
        total, metrics = self._loss(vectors, batch, denominators)
        for dims in self.matryoshka_dims:
            if dims < vectors.shape[-1]:
                total = total + self._loss(vectors[..., :dims], batch, denominators)[0]
        return total, {**metrics, "loss": total}

    def _loss(self, vectors, batch, denominators=None):
        denominator = None if denominators is None else denominators["examples"]
        if self.loss_name == "in_batch":
            return losses.in_batch_loss(vectors, batch["weights"], self.scale, self.symmetric,
                                        denominator)
        if self.loss_name == "cosine":
            return losses.cosine_loss(vectors, batch["labels"], batch["weights"], denominator)
        return losses.cosent_loss(vectors, batch["labels"], batch["weights"], self.scale)

    @property
    def denominators(self):
        """Accumulated micro-batches sum to one batch's mean (CoSENT ranks the pairs of one
        batch: it has no per-example terms, its micro-batches average)."""
        if self.loss_name == "cosent":
            return None
        return lambda batch: {"examples": jnp.maximum(
            jnp.sum(batch["weights"].astype(jnp.float32)), 1e-6)}

    def predict(self, vectors, batch) -> dict[str, Array]:
        return {"vectors": vectors.astype(jnp.float32)}

    def metrics(self, predictions, features, split: str) -> dict[str, float]:
        vectors = np.stack(predictions["vectors"])  # [rows, columns, hidden]
        if features.retrieval is None:
            return metrics_lib.sts(vectors[:, 0], vectors[:, 1], features.labels)
        retrieval = features.retrieval
        queries = len(retrieval.queries)
        scores, indices = metrics_lib.search(vectors[:queries, 0], vectors[queries:, 0], k=100)
        ranked = metrics_lib.rank_ids(indices, list(retrieval.queries), list(retrieval.corpus))
        return metrics_lib.retrieval_metrics(ranked, retrieval.qrels)

    # ---- export and serving

    def hf_head(self):
        return {**hf_head("BertModel"), "pooling": self.pooling.to_dict()}

    def state(self):
        return {"kind": self.kind, "pooling": self.pooling.to_dict(), "columns": self.columns,
                **self.prompts.to_dict(), "lower_case": self.lower_case}

    def restore(self, state):
        """A finished run's state (runs before prompts: none, no lower-casing)."""
        self.kind, self.columns = state["kind"], 1
        self.pooling = Pooling.from_dict(state["pooling"])
        self.prompts = Prompts.from_dict(state)
        self.lower_case = state.get("lower_case") is True

    def read_inputs(self, path, fields):
        """Rows of a .csv / .tsv / .jsonl file, the text in column --text_a."""
        column = fields.get("text_a") or "text"
        encoding = fields.get("encoding") or paths.DEFAULT_ENCODING
        return read_texts(path, (column,), id_column=fields.get("id") or "id", field="text_a",
                          encoding=encoding), False

    def examples(self, items):
        if not items:
            raise DataError("no inputs")
        out = []
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise DataError(f"input[{i}]: give a text (str)")
            out.append(TextsExample(f"input[{i}]", (item,), None, str(i)))
        return out

    def records(self, predictions, features, examples):
        """{id, embedding [hidden]} per text."""
        return [{"id": e.index, "embedding": np.asarray(v)[0].tolist()}
                for e, v in zip(examples, predictions["vectors"])]
