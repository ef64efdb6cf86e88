"""SGLang engines: the in-process engine's life cycle and its requests (`engine.py`), a disaggregated
engine's HTTP server (`server.py`) and its owner's client (`remote.py`), where each listens (`rendezvous.py`),
CPU core placement (`placement.py`) and the trimmed model imports of a start (`startup.py`)."""
