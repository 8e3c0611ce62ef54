"""Training parity with the reference implementation (`python -m bertjax.parity --workdir=DIR`).

A small BERT initialised by bertjax is exported to the matching transformers class and both
sides train from the same weights on the same batches (bertjax's own input pipelines, converted
to torch tensors) with dropout 0, float32, the same schedule, warmup, clipping and
weight-decay mask. Each job records per-step losses on both sides and the final per-tensor
parameter difference (`harness.Row`); `report` writes parity.md, parity.json and
loss_vs_step.png.

Modules: `harness` (the two training loops and the comparison record), `report`, and the row
modules `pretraining`, `finetuning`, `optimizers`, `paths`, each exporting
`JOBS: {name: run(steps, workdir) -> list[Row]}`. torch and transformers (the `test` extra) are
imported inside functions only.
"""
