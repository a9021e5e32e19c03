"""msrl's runtime (layer 4 of ``docs/architecture/layout.md``): one fragment replica and what runs it --
the endpoint and its pattern table, the in-process runtime, the one runtime interface, the
generated programs (``programs/``) and the transports between processes (``transports/``)."""
