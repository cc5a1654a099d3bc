"""The conformance kit: certifies a backend against the reference, op by op.

Run it with ``pytest --pyargs te_core.testing --te-backend NAME``. The pytest plugin
(`te_core.testing.plugin`, registered through the ``pytest11`` entry point) adds the option
and fixtures; `te_core.testing.cases` holds the per-op input generators; `te_core.testing.runner`
runs one case on a backend implementation and compares it with the reference through
`te_core.testing.compare`.
"""
