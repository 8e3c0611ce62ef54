"""config.data.pack for a task family: training batches of packed rows
(data_pipeline/packed_finetune.py), evaluation and prediction unpacked (one example a row, so
their outputs are each example's as the unpacked run computes them).

`PackedTraining` is mixed into a `Task` (bertjax/tasks/base.py) ahead of it. The task sets
`pack`, `grad_accum_steps`, `max_seq_length` (in encode) and `train_batch_size`, and gives
`packed_batch` (features, rows, shape, process_index, process_count) → a global batch's rows
and `packed_label_spec(shape)`, the shapes of its label arrays. Checked by
bertjax/tasks/checks.py against the Task class's `packed_kinds`.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from data_pipeline import packed_finetune

# The token arrays of every packed batch, [rows, seq] int32.
TOKEN_KEYS = ("input_ids", "segment_ids", "input_mask", "packing_ids")


class PackedTraining:
    """The packed-training methods of a Task (module docstring)."""

    pack: bool = False

    def packing_shape(self, features, batch_size: int) -> packed_finetune.PackingShape:
        """The fixed shape of packed training batches of `features`: their rows split evenly
        over every device and micro-batch."""
        return packed_finetune.packing_shape(features.lengths, batch_size, self.max_seq_length,
                                             granule=jax.device_count() * self.grad_accum_steps)

    def packed_batches(self, features, batch_size: int, seed: int
                       ) -> Iterator[dict[str, np.ndarray]]:
        """One training epoch of this host's packed batches of `batch_size` examples each."""
        return packed_finetune.packed_batches(
            features, self.packing_shape(features, batch_size), seed,
            process_index=jax.process_index(), process_count=jax.process_count(),
            make=self.packed_batch)

    def num_packed_batches(self, features, batch_size: int) -> int:
        return len(packed_finetune.plan_packed(features.lengths,
                                               self.packing_shape(features, batch_size), 0))

    def train_rows(self, features, batch_size: int) -> int:
        return self.packing_shape(features, batch_size).rows if self.pack else batch_size

    def train_batch_spec(self, features, batch_size: int, max_seq_length: int):
        if not self.pack:
            return self.batch_spec(batch_size, max_seq_length)
        shape = self.packing_shape(features, batch_size)
        i32 = jnp.int32
        slots = jax.ShapeDtypeStruct((shape.rows, shape.slots), i32)
        return {**{k: jax.ShapeDtypeStruct((shape.rows, shape.length), i32)
                   for k in TOKEN_KEYS},
                "example_starts": slots, "example_index": slots,
                **self.packed_label_spec(shape)}

    def describe_packing(self, features, bucketed_padding: float) -> str:
        """The packing of an epoch (seed 0) against the padding of unpacked batches."""
        return packed_finetune.describe_packing(
            features, self.packing_shape(features, self.train_batch_size), bucketed_padding)

    def packed_batch(self, features, rows, shape, process_index: int, process_count: int
                     ) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def packed_label_spec(self, shape: packed_finetune.PackingShape
                          ) -> dict[str, jax.ShapeDtypeStruct]:
        raise NotImplementedError
