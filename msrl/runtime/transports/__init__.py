"""What moves values between replica processes (layer 4 of ``docs/architecture/layout.md``): the one registry
of transport kinds from which the config's choices are derived (:mod:`~msrl.runtime.transports.kinds`),
synchronous boundaries over ``torch.distributed`` (:mod:`~msrl.runtime.transports.dist`) and
per-pair links (:mod:`~msrl.runtime.transports.links`, :mod:`~msrl.runtime.transports.unix_link`),
shared-memory all-reduce (:mod:`~msrl.runtime.transports.shm`) and the codec of values on the wire
(:mod:`~msrl.runtime.transports.codec`). The asynchronous transports between processes are in
:mod:`msrl.cluster` (they need Ray's processes). Importing this package imports none of them.
"""
