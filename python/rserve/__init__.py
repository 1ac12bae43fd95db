"""rserve: a fast, small LLM serving engine.

The Python package wraps the same engine as the ``rserve`` server binary (module ``rserve._core``).
"""

__all__: list[str] = []
