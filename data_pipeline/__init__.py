"""Raw text in, pre-training batches out (+ the generic fine-tuning batcher). Never imports
bertjax.models, bertjax.train or bertjax.tasks; task-specific readers live in their task
family's folder (bertjax/tasks/<family>/readers.py).

Pre-training data. Writers never import TensorFlow (their worker processes start fast); the
readers are tf.data pipelines.
  corpus.py                  readers of text: reference format, plain, JSONL, TFDS; sharded
  instances.py               NSP sentence pairs exactly as the reference generator
  masking.py                 the masked-LM rules: static (NumPy) and dynamic (tf.data)
  packing.py                 several short examples per row (packing_ids, position_ids); the
                             single-segment examples of a document
  tfrecords.py               writes reference-schema TFRecord shards (TensorFlow-free)
  metadata.py                metadata.json beside the shards: written, read, checked; the
                             dynamic masking config of the data
  create_pretraining_data.py writer: NSP pairs   python -m data_pipeline.create_pretraining_data
  create_segments.py         writer: no-NSP examples   python -m data_pipeline.create_segments
  pretraining_input.py       reader: make_dataset / InputIterator for the trainer, one global
                             order on any number of hosts
  packed_input.py            reader: make_packed_dataset, rows packed with several examples
  hosts.py                   each process's rows of a global batch (every reader's one rule)

Fine-tuning data:
  finetune_data.py           the example types; tokenised, length-bucketed fine-tuning batches

Shared: TensorFlow is imported CPU-only and quiet (bertjax/tf_setup.py); the commands run through
bertjax.cli (absl flags, one-line `error: ...`, as every bertjax command). The demo datasets
and the benchmarks live outside the library, in bertjax/demos and bertjax/benchmarks.
"""
