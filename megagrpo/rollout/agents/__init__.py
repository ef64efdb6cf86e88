"""Bring your own agent: the OpenAI-compatible session endpoint (`endpoint.py`), its per-session recorder
(`session.py`), and the launcher that ends a command agent's whole process tree with its session
(`launcher.py`)."""
