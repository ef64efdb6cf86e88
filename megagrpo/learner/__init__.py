"""The learner: megatron-core policy on a TP x PP x EP x DP mesh.

Modules (import them directly; this package imports nothing heavy):
`mesh` (launcher env, parallel groups), `model` (TransformerConfig/GPTModel from ModelArch, DDP),
`attention` (core attention for the local spec, THD), `layout` (padded/packed/router token layouts),
`logprobs` (vocab-parallel logprobs and entropy), `forward` (schedule-driven forward pass),
`train_step` (forward+backward+optimizer step), `learner` (the `Learner` object), `optimizer`,
`checkpoint`.
"""
