"""Write a tiny Hugging Face model directory with random weights and a locally trained tokenizer.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a built-in corpus (digits kept
as single tokens, so arithmetic tasks tokenise cleanly) and wrapped as a `PreTrainedTokenizerFast`
with a chat template. Tests, benchmarks and the demo build every model they use with `make_tiny_model`.

    python tools/make_tiny_model.py OUT_DIR --arch qwen3_moe [--experts 8 --topk 2 --seed 0]

`--arch deepseek_v3` (multi-latent attention, YaRN; `--q-lora-rank 0` writes `q_lora_rank: null`, a full-rank
query projection as Moonlight and DeepSeek-V2-Lite ship it; `--no-yarn` plain rope, `rope_scaling: null` as
Moonlight ships it) and `--arch glm4_moe` (partial rotary, q/k/v biases,
q/k norms) have DeepSeek-V3's router: sigmoid scores, a non-zero correction bias, group-limited top-k
(2 groups), one shared expert, and a dense first layer; `--mtp-layers 1` adds a multi-token-prediction
layer after the main ones (`num_nextn_predict_layers`), as DeepSeek-V3/R1 and GLM-4.5 ship it.
`--arch gpt_oss` alternates sliding-window (4 tokens, so short tests cross it) and full attention, with
learned sinks, q/k/v/o biases and YaRN without truncation (factor 4 over a quarter of the positions), and a
biased router over experts with biases and gpt-oss's clamped SwiGLU; every bias and sink is random.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from megagrpo.bridge.hf_config_v3 import V3_FAMILIES
from megagrpo.bridge.maps import MAPPED_FAMILIES

# Every family the bridge maps has a tiny model (the bridge's own table, so a new family cannot be missed).
ARCHS = MAPPED_FAMILIES
# DeepSeek-V3-shaped routers: sigmoid scores, a non-zero correction bias, group-limited top-k over 2 groups
# (a group scored by its top-2 experts, so topk_group = topk / 2), shared experts, the first layer dense.
V3_ARCHS = V3_FAMILIES

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model learns to add numbers and to answer in a
strict format. Question: what is 12 + 34? Answer: 46. Question: what is 123 + 456? Answer: 579.
Think step by step, then give the final answer in the form <answer>579</answer>. The sum of two
numbers is computed digit by digit from the right, carrying a one when a column exceeds nine.
Reinforcement learning from verifiable rewards samples several completions for each prompt, scores
each one, and pushes up the probability of completions that beat their group's average.
Mixture of experts models route every token to a few experts chosen by a learned router.
system user assistant You are a helpful assistant. Solve the problem. Use the given numbers once.
Countdown: reach the target using + - * and each number at most once. Target: 24. Numbers: 3 4 6.
"""


def train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on the built-in corpus; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )
    return fast


def make_config(
    arch: str,
    vocab_size: int,
    tok,
    *,
    hidden: int,
    q_lora_rank: int = 32,
    yarn: bool = True,
    mla_dims: tuple[int, int, int, int] = (16, 16, 8, 16),
    layers: int,
    experts: int,
    topk: int,
    tie: bool,
    max_pos: int,
    moe_intermediate: int | None = None,
):
    from transformers import AutoConfig

    heads, kv_heads, head_dim = 4, 2, hidden // 4
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|pad|>"),
        torch_dtype="float32",
    )
    if arch == "qwen3":
        common["head_dim"] = head_dim
    if arch == "qwen3_moe":
        common.update(
            head_dim=head_dim,
            num_experts=experts,
            num_experts_per_tok=topk,
            moe_intermediate_size=moe_intermediate or hidden,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
        )
    if arch == "mixtral":
        common.update(num_local_experts=experts, num_experts_per_tok=topk, output_router_logits=False)
    if arch == "qwen2":
        common.update(use_sliding_window=False)
    if arch in V3_ARCHS:
        if topk % 2 or experts % 2 or topk // 2 > 2:
            raise SystemExit(f"error: --arch {arch} needs an even --topk of 2 or 4 and an even --experts")
        common.update(
            n_routed_experts=experts,
            num_experts_per_tok=topk,
            moe_intermediate_size=moe_intermediate or hidden // 2,
            n_shared_experts=1,
            n_group=2,
            topk_group=topk // 2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            num_nextn_predict_layers=0,
        )
    if arch == "deepseek_v3":
        # Multi-latent attention with a q latent and YaRN (factor 4 over a quarter of the positions), or
        # plain rope (`yarn=False`). The config is what transformers' DeepseekV3Config saves: without the
        # router's `topk_method`/`scoring_func`/`moe_layer_freq`, which the released configs add and
        # SGLang reads (the engine fills them: `rollout.engines.startup.sglang_config_fill`).
        yarn_scaling = {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": max_pos // 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
        common.update(
            num_key_value_heads=heads,
            q_lora_rank=q_lora_rank or None,
            kv_lora_rank=mla_dims[0],
            qk_nope_head_dim=mla_dims[1],
            qk_rope_head_dim=mla_dims[2],
            v_head_dim=mla_dims[3],
            rope_scaling=yarn_scaling if yarn else None,
        )
    if arch == "glm4_moe":
        common.update(head_dim=head_dim, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True)
    if arch == "gpt_oss":
        ffn = moe_intermediate or hidden
        common.update(
            head_dim=head_dim,
            intermediate_size=ffn,
            num_local_experts=experts,
            num_experts_per_tok=topk,
            sliding_window=4,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            attention_bias=True,
            swiglu_alpha=1.702,
            swiglu_limit=7.0,
            output_router_logits=False,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": max_pos // 4,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        )
        common["rope_theta"] = 150000.0  # gpt-oss's
    return AutoConfig.for_model(arch, **common)


def _randomise_v3_extras(model, seed: int) -> None:
    """Non-zero correction biases and q/k/v biases (HF initialises both to zero), so that a bias entering
    the combine weights, or a dropped bias, changes the logits."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    for name, t in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            t.copy_(0.05 * torch.randn(t.shape, generator=g))
    for name, p in model.named_parameters():
        if name.endswith("_proj.bias"):
            p.data.copy_(0.02 * torch.randn(p.shape, generator=g))


def _randomise_gpt_oss_extras(model, seed: int) -> None:
    """Random sinks and biases (attention, router, experts), so that a dropped or misplaced one changes
    the logits; sinks of the size of an attention logit, so that they take a real share of each softmax."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.data.copy_(torch.randn(p.shape, generator=g))
        elif name.endswith(("_proj.bias", "router.bias", "gate_up_proj_bias", "down_proj_bias")):
            p.data.copy_(0.05 * torch.randn(p.shape, generator=g))


def _mtp_tensors(cfg, mtp_layers: int, seed: int) -> dict:
    """{HF name: tensor} of `mtp_layers` multi-token-prediction layers after cfg's main ones, named as
    DeepSeek-V3 and GLM-4.5 ship them: each a full decoder layer (MoE, as every layer after the dense
    first ones) under `model.layers.{n}.`, plus its own `embed_tokens`, `enorm`/`hnorm`, `eh_proj`
    [H, 2H] and `shared_head.{norm,head}` (SGLang's NextN loaders read these names)."""
    import copy

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    n, h = cfg.num_hidden_layers, cfg.hidden_size
    longer = copy.deepcopy(cfg)
    longer.num_hidden_layers = n + mtp_layers
    torch.manual_seed(seed + 7)
    with (
        tempfile.TemporaryDirectory() as tmp
    ):  # saved, so that the names are the checkpoint's, not the module's
        AutoModelForCausalLM.from_config(longer, dtype=torch.float32).save_pretrained(tmp)
        state = load_file(str(Path(tmp) / "model.safetensors"))
    mine = tuple(f"model.layers.{n + i}." for i in range(mtp_layers))
    out = {k: v for k, v in state.items() if k.startswith(mine)}
    g = torch.Generator().manual_seed(seed + 8)
    std = cfg.initializer_range
    for i in range(mtp_layers):
        p = f"model.layers.{n + i}."
        out[p + "embed_tokens.weight"] = std * torch.randn(cfg.vocab_size, h, generator=g)
        out[p + "enorm.weight"] = torch.ones(h)
        out[p + "hnorm.weight"] = torch.ones(h)
        out[p + "eh_proj.weight"] = std * torch.randn(h, 2 * h, generator=g)
        out[p + "shared_head.norm.weight"] = torch.ones(h)
        out[p + "shared_head.head.weight"] = std * torch.randn(cfg.vocab_size, h, generator=g)
    return out


def _add_mtp_layers(model_dir: Path, cfg, mtp_layers: int, seed: int) -> None:
    """Write `_mtp_tensors` into the saved checkpoint and `num_nextn_predict_layers` into its config."""
    from safetensors.torch import load_file, save_file

    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    tensors.update(_mtp_tensors(cfg, mtp_layers, seed))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = mtp_layers
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen3_moe",
    *,
    hidden: int = 64,
    q_lora_rank: int = 32,
    yarn: bool = True,
    mla_dims: tuple[int, int, int, int] = (16, 16, 8, 16),
    layers: int = 2,
    experts: int = 8,
    topk: int = 2,
    vocab_size: int = 1024,
    tie: bool = False,
    max_pos: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    moe_intermediate: int | None = None,
    mtp_layers: int = 0,
) -> Path:
    """Create the model directory atomically (written beside it, then renamed) and return its path.
    `mtp_layers` (deepseek_v3, glm4_moe): multi-token-prediction layers after the main ones, as DeepSeek-V3
    and GLM-4.5 ship them (`num_nextn_predict_layers`; `_mtp_tensors`).
    `moe_intermediate`: the experts' intermediate size (default: `hidden`, or `hidden // 2` for the
    DeepSeek-V3-shaped archs); one that is no multiple of 32 is padded by SGLang's CPU engine.
    `mla_dims` (deepseek_v3): kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim; DeepSeek-V3's
    own are (512, 128, 64, 128), which SGLang's CUDA kernels need (a rope dim of 8 takes their fallback)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise SystemExit(f"error: --arch {arch!r} is not supported; choose one of {', '.join(ARCHS)}")
    if mtp_layers and arch not in V3_ARCHS:
        raise SystemExit(f"error: --mtp-layers needs --arch {' or '.join(V3_ARCHS)}, got {arch}")
    out = Path(out_dir)
    tok = train_tokenizer(min(vocab_size, 1024))
    if len(tok) > vocab_size:
        raise SystemExit(f"error: --vocab-size {vocab_size} is smaller than the tokenizer ({len(tok)})")
    cfg = make_config(
        arch,
        vocab_size,
        tok,
        hidden=hidden,
        q_lora_rank=q_lora_rank,
        yarn=yarn,
        mla_dims=mla_dims,
        layers=layers,
        experts=experts,
        topk=topk,
        tie=tie,
        max_pos=max_pos,
        moe_intermediate=moe_intermediate,
    )
    cfg.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch in V3_ARCHS:
        _randomise_v3_extras(model, seed)
    if arch == "gpt_oss":
        _randomise_gpt_oss_extras(model, seed)
    model.generation_config = GenerationConfig(
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if mtp_layers:
            _add_mtp_layers(tmp, cfg, mtp_layers, seed)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--arch", default="qwen3_moe", choices=ARCHS)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8, help="MoE archs only")
    p.add_argument("--topk", type=int, default=2, help="MoE archs only")
    p.add_argument("--vocab-size", type=int, default=1024, help="model vocab; >= tokenizer size")
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.add_argument("--max-pos", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--q-lora-rank", type=int, default=32, help="deepseek_v3 only; 0 writes q_lora_rank: null (Moonlight)"
    )
    p.add_argument(
        "--mtp-layers",
        type=int,
        default=0,
        help="deepseek_v3/glm4_moe only: multi-token-prediction layers (num_nextn_predict_layers) after the main ones",
    )
    p.add_argument(
        "--no-yarn", action="store_true", help="deepseek_v3 only: plain rope, rope_scaling: null (Moonlight)"
    )
    a = p.parse_args(argv)
    out = make_tiny_model(
        a.out_dir,
        a.arch,
        hidden=a.hidden,
        layers=a.layers,
        experts=a.experts,
        topk=a.topk,
        vocab_size=a.vocab_size,
        tie=a.tie,
        max_pos=a.max_pos,
        seed=a.seed,
        q_lora_rank=a.q_lora_rank,
        mtp_layers=a.mtp_layers,
        yarn=not a.no_yarn,
    )
    print(json.dumps({"out_dir": str(out), "arch": a.arch}))
    return 0
