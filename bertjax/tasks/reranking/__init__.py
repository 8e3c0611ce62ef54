"""Cross-encoder rerankers, in the order the data flows:

  readers.py   training rows (labelled pairs, listwise groups, teacher scores and margins) in
               CSV / TSV / JSONL, and candidate lists (JSONL: a query and its passages)
  (features)   pairs → token ids and length-bucketed batches: data_pipeline/finetune_data.py
  task.py      RerankingTask, the family's plug-in (tasks/base.py): one logit a pair, losses,
               the activation CrossEncoder.predict applies
  losses.py    binary cross-entropy, listwise softmax cross-entropy, MSE, Margin MSE
  metrics.py   nDCG@10 and MRR@10 of each query's candidates ordered by score

The model is bertjax/models/classification.py's BertForSequenceClassification with one label.
"""
