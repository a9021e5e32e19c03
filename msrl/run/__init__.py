"""Running a job, from a config to a run directory (layer 5 of ``docs/architecture/layout.md``): the ``msrl``
command (:mod:`~msrl.run.cli`), ``msrl.train``/``load``/``evaluate`` (:mod:`~msrl.run.python_api`),
a run's attempts and restarts (:mod:`~msrl.run.training`), the training loop
(:mod:`~msrl.run.loop`), the job a run compiles (:mod:`~msrl.run.job`) and the runtime that runs it
(:mod:`~msrl.run.driver`), and what a run writes (run directories, checkpoints, metrics, curves,
evaluations, populations). Importing this package imports none of them.
"""
