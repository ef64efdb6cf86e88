"""Process-group mechanics below every layer that runs collectives: where a collective's buffers live
(`wire.py`) and the agreement on a failure before the next collective (`agree.py`). torch.distributed and
`errors` only, so rollout, sync and trainer all import it."""
