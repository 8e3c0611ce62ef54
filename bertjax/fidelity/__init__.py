"""End-to-end fidelity against transformers (`python -m bertjax.fidelity`, `make fidelity`):
every fine-tuning family trained by bertjax's own command and by a plain transformers script
on the same real files, seeds and settings, compared by the official dev metric. Needs the
test extra (torch, transformers, seqeval, scipy) for the reference side."""
