"""Sentence embeddings and retrieval, in the order the data flows:

  readers.py   pairs / triplets / scored pairs (CSV, TSV, JSONL) and BEIR retrieval sets
  (features)   texts → token ids and length-bucketed batches: data_pipeline/finetune_data.py
  prompts.py   the prompts of each column and lower-casing, as sentence-transformers applies them
  task.py      EmbeddingTask, the family's plug-in (tasks/base.py): vectors, losses, metrics
  losses.py    in-batch negatives over the global batch, CoSENT, cosine
  metrics.py   STS correlations; exact search and nDCG / MRR / Recall

The model (encoder + pooling + normalisation) is bertjax/models/embedding.py's.
"""
