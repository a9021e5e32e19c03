"""Fragment backends, one module each; the module name is the YAML value of a fragment's
``backend`` and its ``BACKEND`` is the backend (see :mod:`msrl.runtime.programs.backends`)."""
