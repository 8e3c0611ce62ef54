"""The cost instrument: ahead-of-time compiles of the train and predict steps, for this
machine's devices or a Cloud TPU slice (libtpu, on any machine), and what they cost.
  dry_run.py          --dry_run's entry points: parameter table, local memory and FLOPs
  measure.py          compile a stage's step (layers unrolled, extrapolated), its Measure
  report.py           --topology's per-chip table, notes, fit hints, --breakdown
  sweep.py            --sweep: meshes, batch sizes and remat, ranked
  topology.py         slice names → TPU topologies, chips, peak FLOPs and HBM
  hlo_costs.py        the optimized HLO op by op: bytes, FLOPs, the compiler's cycles
  kernel_schedule.py  the flash kernels' compiled schedule
  inference.py        the predict step's dry run (python -m bertjax.predict --dry_run)
Nothing below (models, train, tasks, serving) imports it.
"""
