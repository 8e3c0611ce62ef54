"""SQuAD v1.1 / v2.0 extractive question answering (`config.task.family = squad`), in the order
the data flows: readers.py (official JSON and TFDS splits → questions) → features.py (windows
from the tokenizer's character offsets) → task.py (the fine-tuning plug-in: batches, span
loss; the head is models/squad.py) → postprocess.py (window logits → n-best answers) →
metrics.py (official EM / F1 and the v2.0 null threshold) → postprocess.py's prediction files.
"""
