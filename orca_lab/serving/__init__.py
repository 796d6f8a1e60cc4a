"""ORCA as a server: the OpenAI-compatible endpoint over the engine loop (``server``), its request and
response shapes (``protocol``), its Prometheus metrics (``metrics``) and a load generator (``bench``).
Serving sits above ``orca_lab.llm`` and below the CLI (DESIGN.md)."""
