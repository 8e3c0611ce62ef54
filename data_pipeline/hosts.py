"""How a global batch is split over the processes of a multi-host run: process i of n takes
rows [i * batch / n, (i + 1) * batch / n). Every reader (pre-training, fine-tuning, tagging,
SQuAD) builds the same global batch on every process and applies this one rule, so the batch
at a step does not depend on the number of hosts."""

from __future__ import annotations


def host_rows(batch_size: int, process_index: int, process_count: int) -> slice:
    """This process's rows of a global batch of `batch_size` rows."""
    if batch_size % process_count:
        raise ValueError(f"batch size {batch_size} is not divisible by {process_count} "
                         "processes")
    per_host = batch_size // process_count
    return slice(process_index * per_host, (process_index + 1) * per_host)
