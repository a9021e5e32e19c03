"""The front end's passes over the fragmented graph and the pipeline that composes them.

Each pass is a function ``FragmentGraph -> FragmentGraph`` that returns a new graph (its input
untouched): :func:`~msrl.frontend.collectives.place_collectives` (the all-reduces at a replicated
learner's collective points) and :func:`~msrl.frontend.serving.serve_inference` (central
inference's plan and served region). :mod:`msrl.frontend.pipeline` runs trace -> probe ->
partition -> passes -> code generation once per job.
"""
