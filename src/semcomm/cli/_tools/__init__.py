"""Tooling behind CLI commands, not library API: each module serves one command group.

* ``probe_harness``: the timing-attack harness of ``semcomm security probe``.
* ``demo``: the embedded-default demo of ``semcomm quickstart`` (cold then warm, report, chart).
* ``route_sim``, ``route_trace``, ``route_report``: the replica-routing simulator, traces
  (Mooncake format, synthetic shared-prefix workloads) and the tables and charts of
  ``semcomm route simulate``, ``route synth`` and ``route eval``.
* ``fusion_reference``: C2C evaluation on the reference world (``semcomm fusion eval/train``).

These import the library only through each package's ``__init__`` (docs/architecture.md,
"Packages"); the library never imports them.
"""
