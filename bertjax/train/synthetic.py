"""A deterministic synthetic pre-training input (NumPy), for tests, benchmarks and dry checks.

Batch `i` depends only on (seed, i), and each process takes its rows of the global batch, so
runs on any number of processes and devices see the same global batches.
"""

from __future__ import annotations

import json

import numpy as np
from etils import epath


class SyntheticInput:
    def __init__(self, global_batch_size: int, seq_len: int, max_predictions: int,
                 vocab_size: int, seed: int = 0, process_index: int = 0, process_count: int = 1):
        self.global_batch_size = global_batch_size
        self.seq_len, self.max_predictions, self.vocab_size = seq_len, max_predictions, vocab_size
        self.seed, self.position = seed, 0
        rows = global_batch_size // process_count
        self.rows = slice(process_index * rows, (process_index + 1) * rows)

    def global_batch(self, index: int) -> dict[str, np.ndarray]:
        r = np.random.default_rng([self.seed, index])
        b, s, p = self.global_batch_size, self.seq_len, self.max_predictions
        # Zipf-like token frequencies and a copy structure (segment B repeats segment A) give
        # the model something learnable.
        first = r.zipf(1.3, (b, s // 2)) % (self.vocab_size - 5) + 5
        ids = np.concatenate([first, first[:, : s - s // 2]], axis=1).astype(np.int32)
        lengths = r.integers(s // 2, s + 1, b)
        input_mask = (np.arange(s)[None] < lengths[:, None]).astype(np.int32)
        positions = np.stack([np.sort(r.choice(np.arange(1, n), p, replace=False))
                              for n in lengths]).astype(np.int32)
        masked_ids = np.take_along_axis(ids, positions, 1)
        masked_input = ids.copy()
        np.put_along_axis(masked_input, positions, 4, 1)  # 4 stands for [MASK]
        return {
            "input_ids": masked_input * input_mask,
            "input_mask": input_mask,
            "segment_ids": ((np.arange(s)[None] >= s // 2) * input_mask).astype(np.int32),
            "masked_lm_positions": positions,
            "masked_lm_ids": masked_ids,
            "masked_lm_weights": np.ones((b, p), np.float32),
            "next_sentence_labels": r.integers(0, 2, b).astype(np.int32),
        }

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.global_batch(self.position)
        self.position += 1
        return {k: v[self.rows] for k, v in batch.items()}

    def save(self, prefix: str) -> None:
        epath.Path(prefix + ".json").write_text(json.dumps({"position": self.position}))

    def restore(self, prefix: str) -> None:
        self.position = json.loads(epath.Path(prefix + ".json").read_text())["position"]
