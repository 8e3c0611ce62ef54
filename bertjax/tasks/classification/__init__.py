"""Sequence-level fine-tuning: classification, regression and multiple choice (GLUE, SWAG,
users' own CSV / TSV / JSONL files), in the order the data flows:

  readers.py     GLUE (official directories or TFDS), SWAG and users' files → examples
  (features)     examples → token ids and length-bucketed batches: data_pipeline/finetune_data.py
  task.py        SequenceTask, the family's plug-in (tasks/base.py): head, losses, predictions
  metrics.py     the official GLUE / SWAG dev metrics
  submission.py  GLUE leaderboard files of the test predictions

The heads (flax modules) are bertjax/models/classification.py's. Importing this package loads
nothing; readers.py (and TensorFlow, for TFDS only) is imported when a task reads its files.
"""
