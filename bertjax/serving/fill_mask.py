"""Fill-mask: the masked-LM head of a pre-trained checkpoint directory (`bertjax.FillMask`,
`python -m bertjax.predict fill_mask`): BertForPreTraining's, or a ModernBERT's
ModernBertForMaskedLM."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.errors import DataError
from bertjax.models import ModelConfig, architecture
from bertjax.serving.engine import DATA_PARALLEL_MESH, DATA_PARALLEL_RULES, runner_and_params
from bertjax.train import configs


class FillMask:
    """Top-k fillers of each [MASK] of a text, from a bertjax checkpoint directory's MLM head.

        fill = bertjax.FillMask.from_checkpoint("runs/demo/export")
        fill("the capital of france is [MASK].", top_k=5)
        → [{"position": 6, "candidates": [{"token", "word", "probability", "sequence"}]}]

    Probabilities are the softmax over the whole vocabulary; the candidates skip special
    tokens (and the embedding rows past the tokenizer's vocabulary, a ModernBERT's padding).
    A WordPiece continuation (`##s`) is shown as the whole word it completes (`word`).
    Texts run in fixed-shape batches of length buckets (16, 32, ..., max_seq_length), sharded
    over the data-parallel devices.
    """

    def __init__(self, model_config: ModelConfig, params, tokenizer, max_seq_length: int = 128,
                 batch_size: int = 8):
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.max_seq_length = min(max_seq_length, model_config.max_position_embeddings)
        model, init_inputs, logits = mlm_model(model_config)
        self.runner, self.params = runner_and_params(
            model, init_inputs, params, DATA_PARALLEL_MESH, DATA_PARALLEL_RULES, batch_size)

        def probabilities(params, batch):  # [batch, masks, vocab] float32
            return jax.nn.softmax(logits(params, batch).astype(jnp.float32), axis=-1)

        self._probabilities = jax.jit(probabilities)

    @classmethod
    def from_checkpoint(cls, directory: str, max_seq_length: int = 128, batch_size: int = 8,
                        dtype: str | None = None) -> FillMask:
        from bertjax.checkpoint_dir import load_pretrained

        overrides = {"dtype": configs.compute_dtype(dtype or "auto")}
        config, params, tokenizer = load_pretrained(directory, **overrides)
        return cls(config, params, tokenizer, max_seq_length, batch_size)

    def probabilities(self, texts: list[str]) -> list[tuple[Any, np.ndarray]]:
        """(encoding, [masks, vocab] probabilities at its [MASK] positions) per text."""
        from data_pipeline.finetune_data import bucket_lengths
        from data_pipeline.hosts import host_rows

        encodings = [self.tokenizer.encode(t, max_seq_length=self.max_seq_length)
                     for t in texts]
        masks = []
        for i, enc in enumerate(encodings):
            found = [p for p, t in enumerate(enc.input_ids) if t == self.tokenizer.mask_id]
            if not found:
                raise DataError(f"text {i + 1} ({texts[i][:40]!r}) has no [MASK] within "
                                f"{self.max_seq_length} tokens")
            masks.append(found)
        buckets = bucket_lengths(self.max_seq_length, min(16, self.max_seq_length))
        width = max(len(m) for m in masks)
        out: list = [None] * len(texts)
        order = sorted(range(len(texts)), key=lambda i: sum(encodings[i].input_mask))
        for first in range(0, len(order), self.batch_size):
            rows = order[first:first + self.batch_size]
            longest = max(sum(encodings[i].input_mask) for i in rows)
            length = next(b for b in buckets if b >= longest)
            batch = {k: np.zeros((self.batch_size, length), np.int32)
                     for k in ("input_ids", "segment_ids", "input_mask")}
            batch["positions"] = np.zeros((self.batch_size, width), np.int32)
            for r, i in enumerate(rows):
                enc = encodings[i]
                batch["input_ids"][r] = enc.input_ids[:length]
                batch["segment_ids"][r] = enc.segment_ids[:length]
                batch["input_mask"][r] = enc.input_mask[:length]
                batch["positions"][r, :len(masks[i])] = masks[i]
            mine = host_rows(self.batch_size, jax.process_index(), jax.process_count())
            _, probs = next(self.runner.run(self._probabilities, self.params,
                                            [{k: v[mine] for k, v in batch.items()}]))
            for r, i in enumerate(rows):
                out[i] = (encodings[i], masks[i], np.asarray(probs[r, :len(masks[i])]))
        return out

    def __call__(self, text: str | list[str], top_k: int = 5):
        """Per text (a list for a list of texts): [{position, candidates}] per [MASK]."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts:
            raise DataError("no texts")
        results = [self._candidates(*row, top_k) for row in self.probabilities(texts)]
        return results[0] if isinstance(text, str) else results

    def _candidates(self, enc, masks: list[int], probs: np.ndarray, top_k: int) -> list[dict]:
        tokenizer = self.tokenizer
        special = np.zeros(probs.shape[-1], bool)
        special[list(tokenizer.special_ids)] = True
        special[tokenizer.vocab_size:] = True  # a ModernBERT's padding rows: no token
        n = int(sum(enc.input_mask))
        out = []
        for m, position in enumerate(masks):
            p = np.where(special, -1.0, probs[m])
            best = np.argsort(-p, kind="stable")[:top_k]
            candidates = []
            for token_id in best:
                token = tokenizer.convert_ids_to_tokens([int(token_id)])[0]
                ids = list(enc.input_ids[1:n - 1])  # without [CLS] / [SEP]
                ids[position - 1] = int(token_id)
                word = whole_word(tokenizer, enc.tokens, enc.input_ids[:n], position,
                                  int(token_id))
                candidates.append({"token": token, "word": word,
                                   "probability": float(probs[m, token_id]),
                                   "sequence": tokenizer.decode(ids)})
            out.append({"position": position, "candidates": candidates})
        return out


def mlm_model(config: ModelConfig):
    """(module, its init inputs, logits(params, batch) → [batch, masks, vocab] at
    batch["positions"]) of the checkpoint's masked-LM model: BertForPreTraining (its "mlm"
    head) or ModernBertForMaskedLM (segment ids unread): its architecture's
    `pretraining_model`."""
    ids, positions = jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    record = architecture(config)
    model = record.pretraining_model(config)
    init_inputs = record.pretraining_args({"input_ids": ids, "segment_ids": ids,
                                           "input_mask": ids, "masked_lm_positions": positions})

    def logits(params, batch):
        batch = dict(batch, masked_lm_positions=batch["positions"])
        return record.pretraining_outputs(model, {"params": params}, batch)["mlm_logits"]

    return model, init_inputs, logits


def whole_word(tokenizer, tokens: list[str], ids: list[int], position: int,
               token_id: int) -> str:
    """The word a candidate `token_id` at `position` makes, decoded (a byte-level BPE's "Ġof"
    is "of"): the candidate joined to the pieces of its word around it — back to the word's
    first piece where the candidate continues a word, on through the continuations after it
    (`tokenizer.is_continuation`: WordPiece's "##", a piece without BPE's "Ġ" marker)."""
    token = tokenizer.convert_ids_to_tokens([token_id])[0]
    start = position
    if tokenizer.is_continuation(token):
        while start > 1 and tokenizer.is_continuation(tokens[start - 1]):
            start -= 1
        start -= start > 1  # the word's first piece (not [CLS])
    end = position + 1
    while end < len(tokens) and tokenizer.is_continuation(tokens[end]):
        end += 1
    span = [token_id if i == position else ids[i] for i in range(start, end)]
    # A WordPiece continuation with no piece before it (after [CLS]) decodes with its "##".
    return tokenizer.decode(span).strip().removeprefix("##") or token
