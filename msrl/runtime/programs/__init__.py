"""A fragment's programs in a replica (layer 4 of ``docs/architecture/layout.md``): code generation from its
region graph (:mod:`~msrl.runtime.programs.codegen`) by its backend's lowering rules (registry:
:mod:`~msrl.runtime.programs.backends`), and the wrappers around a generated program: CUDA-graph
capture and replay (:mod:`~msrl.runtime.programs.capture`), compiled fragments
(:mod:`~msrl.runtime.programs.compiled`) and host-sync probing
(:mod:`~msrl.runtime.programs.host_syncs`). Importing this package imports none of them.
"""
