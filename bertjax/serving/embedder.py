"""`bertjax.Embedder`: sentence vectors and exact search, from a finished embedding run, its
export, or any bertjax checkpoint directory (a converted sentence-transformers model keeps
its pooling in pooling.json, its prompts and lower-casing in conversion.json; another BERT is
mean-pooled).

    embedder = bertjax.Embedder.from_checkpoint("checkpoints/minilm")
    vectors = embedder(["a sentence", ...])                  # [n, hidden] float32
    queries = embedder.embed_queries(["a question", ...])    # the model's query prompt
    passages = embedder.embed_documents(["a passage", ...])  # its document prompt
    scores, rows = embedder.search(queries, passages, k=10)

Prompts apply as sentence-transformers' encode / encode_query / encode_document apply them:
`prompt` (the text itself) wins, else `prompt_name` (one of the model's prompts), else the
model's default prompt (encode) or its "query" / "document" prompt.

Texts run through the serving engine (length buckets, a mesh or CPU devices in turn), so a
text's vector does not depend on the texts it is batched with.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath

from bertjax import checkpoint_dir, paths
from bertjax.errors import ConfigError, DataError
from bertjax.models import heads
from bertjax.models.embedding import Pooling, Prompts
from bertjax.serving.engine import DATA_PARALLEL_MESH, DATA_PARALLEL_RULES, Engine
from bertjax.serving.runs import TrainedModel, load_export, load_workdir
from bertjax.tasks import get_task
from bertjax.tasks.embedding import metrics
from bertjax.tasks.embedding.prompts import with_prompts
from bertjax.train import configs


def checkpoint_config(pooling: Pooling, max_seq_length: int, batch_size: int
                      ) -> ml_collections.ConfigDict:
    """The run config an embedding task of a plain checkpoint directory reads."""
    return ml_collections.ConfigDict(dict(
        init_checkpoint="", max_seq_length=max_seq_length, min_bucket_length=16,
        task=dict(family="embedding", name="embed", kind="pairs", pooling=pooling.mode,
                  normalize=str(pooling.normalize).lower(), loss="auto", scale=20.0,
                  symmetric=False),
        train=dict(group_by_length=False), data=dict(text_a="text", id="id"),
        eval=dict(batch_size=batch_size), mesh=dict(DATA_PARALLEL_MESH),
        logical_axis_rules=DATA_PARALLEL_RULES))


def load_checkpoint(directory: str, max_seq_length: int | None = None,
                    pooling: Pooling | None = None, batch_size: int = 64,
                    dtype: str | None = None) -> TrainedModel:
    """A bertjax checkpoint directory as an embedding model: `pooling`, else its pooling.json,
    else mean pooling without normalisation; texts cut to `max_seq_length` tokens, else the
    model's own (a converted sentence-transformers model's), else 128; at most the model's
    positions; the model's own prompts and lower-casing (a converted one's, else none)."""
    pooling = pooling or checkpoint_dir.load_pooling(directory) or Pooling()
    model_config, params, tokenizer = checkpoint_dir.load_pretrained(
        directory, dtype=configs.compute_dtype(dtype or "auto"))
    max_seq_length = checkpoint_dir.max_seq_length(directory, max_seq_length,
                                                   model_config.max_position_embeddings)
    config = checkpoint_config(pooling, max_seq_length, batch_size)
    task = get_task(config)
    task.restore({"kind": "pairs", "pooling": pooling.to_dict(), "columns": 1,
                  **checkpoint_dir.own_prompts(directory).to_dict(),
                  "lower_case": checkpoint_dir.own_lower_case(directory)})
    group = heads.encoder_name(model_config)  # "bert", a ModernBERT's "model"
    return TrainedModel(str(directory), config, task, model_config, {group: params[group]},
                        tokenizer, 0)


class Embedder:
    """Vectors [n, hidden] float32 of texts, of files (a chunk at a time), and exact search."""

    def __init__(self, trained: TrainedModel, batch_size: int | None = None,
                 devices: Sequence[jax.Device] | None = None):
        if trained.config.task.family != "embedding":
            raise ConfigError(f"{trained.workdir}: a {trained.config.task.family} run gives no "
                              "sentence vectors (an embedding run, or a checkpoint directory "
                              "with --checkpoint, does)")
        self.trained, self.task = trained, trained.task
        self.engine = Engine(trained, batch_size, devices)

    @classmethod
    def from_workdir(cls, workdir: str, batch_size: int | None = None,
                     dtype: str | None = None, devices=None) -> Embedder:
        return cls(load_workdir(workdir, dtype), batch_size, devices)

    @classmethod
    def from_export(cls, directory: str, batch_size: int | None = None,
                    dtype: str | None = None, devices=None) -> Embedder:
        return cls(load_export(directory, dtype), batch_size, devices)

    @classmethod
    def from_checkpoint(cls, directory: str, max_seq_length: int | None = None,
                        pooling: Pooling | None = None, batch_size: int | None = None,
                        dtype: str | None = None, devices=None) -> Embedder:
        return cls(load_checkpoint(directory, max_seq_length, pooling, batch_size or 64, dtype),
                   batch_size, devices)

    @property
    def pooling(self) -> Pooling:
        return self.task.pooling

    @property
    def prompts(self) -> Prompts:
        """The model's prompts (a converted model's own, or those a run trained with)."""
        return self.task.prompts

    def _vectors(self, examples: list, prompt: str) -> np.ndarray:
        _, predictions, _ = self.engine.run(with_prompts(examples, (prompt,)))
        return np.stack([np.asarray(v)[0] for v in predictions["vectors"]]).astype(np.float32)

    def __call__(self, texts: Sequence[str], prompt_name: str | None = None,
                 prompt: str | None = None) -> np.ndarray:
        """[len(texts), hidden]: sentence-transformers' encode (the default prompt unless
        `prompt_name` or `prompt` says otherwise)."""
        return self._vectors(self.task.examples(list(texts)),
                             self.prompts.text(prompt_name, prompt))

    def embed_queries(self, texts: Sequence[str], prompt_name: str | None = None,
                      prompt: str | None = None) -> np.ndarray:
        """As encode_query: the model's "query" prompt unless told otherwise."""
        return self._vectors(self.task.examples(list(texts)),
                             self.prompts.text(prompt_name, prompt, role="query"))

    def embed_documents(self, texts: Sequence[str], prompt_name: str | None = None,
                        prompt: str | None = None) -> np.ndarray:
        """As encode_document: the model's "document" prompt unless told otherwise."""
        return self._vectors(self.task.examples(list(texts)),
                             self.prompts.text(prompt_name, prompt, role="document"))

    def _fields(self, fields: dict[str, Any] | None) -> dict[str, Any]:
        merged = {**dict(self.trained.config.get("data", {})),
                  **{k: v for k, v in (fields or {}).items() if v is not None}}
        paths.check_encoding(merged.get("encoding") or paths.DEFAULT_ENCODING, "--encoding")
        return merged

    def embed_file(self, path: str, fields: dict[str, Any] | None = None,
                   chunk_rows: int = 0, prompt: str | None = None
                   ) -> Iterator[tuple[list[str], np.ndarray]]:
        """(ids, vectors [rows, hidden]) of a .csv / .tsv / .jsonl file's texts (column
        fields["text_a"], ids fields["id"] else row numbers), `chunk_rows` rows at a time (0:
        the whole file at once); the same vectors either way. prompt: the text prepended to
        each (default: the model's default prompt, as encode; `prompts.text` resolves a
        name or a role)."""
        if not paths.exists(path):
            raise DataError(f"{path}: no such file")
        fields = self._fields(fields)
        prompt = self.prompts.text(prompt=prompt)
        if not chunk_rows:
            examples, _ = self.task.read_inputs(path, fields)
            yield [e.index for e in examples], self._vectors(examples, prompt)
            return
        with tempfile.TemporaryDirectory() as directory:
            for chunk, start in self.task.input_chunks(path, chunk_rows, fields, directory):
                try:
                    examples, _ = self.task.read_inputs(chunk, {**fields, "encoding": "utf-8"})
                except DataError as e:  # name the user's file, not the chunk
                    raise DataError(re.sub(
                        re.escape(chunk) + r":(\d+)",
                        lambda m, start=start: f"{path}: row {start + int(m.group(1))}",
                        str(e))) from None
                # The chunks carry every row's id (its row number in `path` where it has none).
                yield [e.index for e in examples], self._vectors(examples, prompt)
                os.remove(chunk)

    def search(self, queries: np.ndarray, corpus: np.ndarray, k: int = 10
               ) -> tuple[np.ndarray, np.ndarray]:
        """(scores [q, k], corpus rows [q, k]) of the k nearest corpus vectors of each query
        by cosine, best first (exact: every corpus row is scored)."""
        return metrics.search(queries, corpus, k)




class VectorFile:
    """A .npy file of float32 rows [n, hidden] written a chunk at a time (its row count is
    written into the header at `close`), and the rows' ids beside it (IDS_SUFFIX: one JSON
    string a line)."""

    HEADER_BYTES = 128  # NumPy format 1.0: magic, version, length, then the padded header

    def __init__(self, path: str):
        check_vectors_path(path)
        self.path, self.rows, self.hidden = path, 0, None
        # Written under temporary names, renamed by `close`: an interrupted run leaves no
        # half-written vectors.
        self._vectors = paths.open(path + PARTIAL, "wb")
        self._ids = paths.open(ids_path(path) + PARTIAL, "w", encoding="utf-8")
        self._vectors.write(b"\0" * self.HEADER_BYTES)

    def _header(self) -> bytes:
        fields = repr({"descr": "<f4", "fortran_order": False,
                       "shape": (self.rows, self.hidden or 0)})
        text = fields.ljust(self.HEADER_BYTES - 10 - 1) + "\n"
        return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode("latin1")

    def write(self, ids: list[str], vectors: np.ndarray) -> None:
        self.hidden = vectors.shape[1]
        self._vectors.write(np.ascontiguousarray(vectors, "<f4").tobytes())
        self._ids.write("".join(json.dumps(str(i), ensure_ascii=False) + "\n" for i in ids))
        self.rows += len(ids)

    def close(self) -> None:
        self._vectors.seek(0)
        self._vectors.write(self._header())
        self._vectors.close()
        self._ids.close()
        for final in (self.path, ids_path(self.path)):
            epath.Path(final + PARTIAL).replace(final)

    def abort(self) -> None:
        """Closes and removes the temporary files (a failed or interrupted run)."""
        for handle, final in ((self._vectors, self.path), (self._ids, ids_path(self.path))):
            handle.close()
            epath.Path(final + PARTIAL).unlink(missing_ok=True)


def check_vectors_path(path: str) -> None:
    if not path.endswith(".npy"):
        raise ConfigError(f"--output={path}: vectors are written to a .npy file")


def ids_path(vectors_path: str) -> str:
    """The ids file beside a vectors .npy file: NAME.npy → NAME.ids.jsonl."""
    return vectors_path[:-len(".npy")] + IDS_SUFFIX


IDS_SUFFIX = ".ids.jsonl"
PARTIAL = ".partial"
