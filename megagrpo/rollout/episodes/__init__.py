"""Multi-turn episodes: the turn driver (`multi_turn.py`), the trajectory recorded token for token
(`trajectory.py`), chat-template deltas (`chat_delta.py`), and the parsing of a model turn into reasoning
(`reasoning.py`) and tool calls (`tool_calls.py`)."""
