"""The front end: a trainer's source to the fragmented graph every runtime runs (DESIGN.md §2-3).

In processing order: the tracer (:mod:`msrl.frontend.tracer`: ``ast`` of ``Trainer.reset`` and
``train_step`` -> :class:`~msrl.graph.Graph`), the probe (:mod:`msrl.frontend.probe`: values'
shapes and kinds), the partitioner (:mod:`msrl.frontend.partition`: graph + policy ->
:class:`~msrl.graph.fragmented.FragmentGraph`), then the passes, each a function
``FragmentGraph -> FragmentGraph`` that returns a new graph and leaves its input untouched:
:func:`~msrl.frontend.collectives.place_collectives` (the all-reduces at a replicated learner's
collective points) and :func:`~msrl.frontend.serving.serve_inference` (central inference's plan
and served region). :mod:`msrl.frontend.pipeline` composes them once per job. Nothing in the
runtime imports this package.
"""
