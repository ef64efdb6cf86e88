"""Convert a megagrpo megatron-core dist checkpoint back into a Hugging Face model directory.

    megagrpo convert megatron-to-hf CKPT_DIR OUT_DIR [--dtype bfloat16] [--max-shard-bytes N]
    torchrun --nproc-per-node 4 -m megagrpo.convert.megatron_to_hf CKPT_DIR OUT_DIR --tp 2 --ep 2

OUT_DIR receives sharded safetensors (+ index), `config.json`, tokenizer and generation config, loadable
by `transformers.AutoModelForCausalLM` and SGLang. Multi-token-prediction layers (DeepSeek-V3's and
GLM-4.5's num_nextn_predict_layers), which the learner does not train, are written back unchanged from
the tensors `hf-to-megatron` stored beside the checkpoint (or from `--mtp-from HF_DIR`), so the export
loads wherever the original did; without them it says num_nextn_predict_layers=0. The model is loaded on the current mesh (one process,
or the torchrun mesh given by --tp/--pp/--ep/--etp) and exported through the same streaming iterator the
weight sync uses (`megagrpo.bridge.export.iter_hf_buckets`): TP/EP shards and PP stages are gathered to
rank 0, which writes one shard file per bucket. Output is written atomically (temp dir + rename).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from megagrpo.bridge.export import ExportGroups, export_tensors, iter_hf_buckets
from megagrpo.bridge.hf_config import exported_config
from megagrpo.bridge.hf_io import (
    HFCheckpoint,
    atomic_output_dir,
    copy_side_files,
    mtp_buckets,
    write_hf_checkpoint,
)
from megagrpo.bridge.maps import hf_names
from megagrpo.bridge.mxfp4 import QUANTIZATION_CONFIG, mxfp4_buckets, mxfp4_names
from megagrpo.config.model import ModelArch
from megagrpo.convert.hf_to_megatron import DTYPES, build_model, init_single_process, read_checkpoint_info
from megagrpo.errors import MegagrpoError

DEFAULT_SHARD_BYTES = 4 * 1024**3
log = logging.getLogger(__name__)


def load_model(ckpt_dir: Path, arch: ModelArch, mesh_cfg, dtype: torch.dtype) -> list:
    """Build this rank's chunks on the current mesh and load the dist checkpoint into them."""
    from megatron.core import dist_checkpointing

    chunks = build_model(arch, mesh_cfg, dtype=dtype)
    for chunk in chunks:
        try:
            state = dist_checkpointing.load(chunk.sharded_state_dict(), str(ckpt_dir))
        except (RuntimeError, KeyError, ValueError) as e:
            raise MegagrpoError(
                f"{ckpt_dir}: cannot load the dist checkpoint into a {arch.family} model: {e}"
            ) from e
        # a learner checkpoint's common state adds top-level entries (content_metadata, other chunks)
        own = set(chunk.state_dict())
        chunk.load_state_dict({k: v for k, v in state.items() if k in own}, strict=True)
    return chunks


def layer_offset(chunk) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(chunk.config)


def _mtp_source(
    ckpt: Path, arch: ModelArch, mtp_from: str | Path | None, shard_bytes: int
) -> tuple[list[str], Iterator[list[tuple[str, torch.Tensor]]]]:
    """(names, buckets of at most `shard_bytes`) of the multi-token-prediction tensors to write unchanged
    beside the exported model: from `mtp_from` (an HF model directory, e.g. the one a learner's run started
    from) when given, else those `convert` stored beside the checkpoint; none when the model has none."""
    if not arch.mtp_layers:
        return [], iter(())
    if mtp_from is None:
        return mtp_buckets(ckpt)
    src = HFCheckpoint(mtp_from)
    if (src.arch.num_layers, src.arch.mtp_layers) != (arch.num_layers, arch.mtp_layers):
        raise MegagrpoError(
            f"--mtp-from {mtp_from}: its config.json has {src.arch.num_layers} layers and "
            f"num_nextn_predict_layers={src.arch.mtp_layers}, the checkpoint {arch.num_layers} and "
            f"{arch.mtp_layers}; pass the HF directory the checkpoint was converted or trained from"
        )
    return src.mtp_names(), src.iter_mtp(shard_bytes)


def export(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    mtp_from: str | Path | None = None,
    mxfp4: bool = False,
) -> dict | None:
    """Export on the current mesh; rank 0 returns a summary, other ranks None. Multi-token-prediction
    tensors (not trained) are written unchanged from beside the checkpoint or from `mtp_from`. `mxfp4`:
    the stacked expert weights (gpt-oss) in the MXFP4 layout the release ships (`bridge.mxfp4`)."""
    import torch.distributed as dist

    ckpt = Path(ckpt_dir)
    meta = read_checkpoint_info(ckpt)  # refuse foreign directories before touching anything
    arch = ModelArch.from_dict(meta["arch"])
    quantised = mxfp4_names(arch) if mxfp4 else []  # refuses a family without stacked experts
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MegagrpoError(
            f"{out}: output directory exists and is not empty; remove it or choose another path"
        )
    load_dtype = DTYPES[meta["dtype"]]
    out_dtype = DTYPES[dtype] if dtype else load_dtype
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        from megagrpo.compat import apply_cpu_compat
        from megagrpo.learner.mesh import MeshConfig, init_mesh

        apply_cpu_compat()
        mesh_cfg = MeshConfig(
            tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1 and arch.is_moe,
            first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
        )  # fmt: skip
        init_mesh(mesh_cfg)
    else:
        if (tp, pp, ep, etp) != (1, 1, 1, 1):
            raise MegagrpoError("--tp/--pp/--ep/--etp > 1 need torchrun with that many processes")
        init_single_process()
        from megagrpo.learner.mesh import MeshConfig

        mesh_cfg = MeshConfig()
    from megatron.core import parallel_state

    chunks = load_model(ckpt, arch, mesh_cfg, load_dtype)
    if len(chunks) != 1:
        raise MegagrpoError("virtual pipeline stages are not supported by the exporter; unset mesh.vpp")
    groups = ExportGroups.from_parallel_state(parallel_state, layer_offset=layer_offset(chunks[0]))
    buckets = iter_hf_buckets(
        export_tensors(chunks[0]), arch, bucket_bytes=max_shard_bytes, groups=groups, dtype=out_dtype
    )
    if dist.get_rank() != 0:
        for _ in buckets:  # drive the collectives; only rank 0 receives tensors
            pass
        return None
    mtp_names, mtp = _mtp_source(ckpt, arch, mtp_from, max_shard_bytes)
    names = hf_names(arch)
    if quantised:
        buckets = mxfp4_buckets(buckets, quantised)
        names = [n for n in names if n not in quantised]
        names += [n + part for n in quantised for part in ("_blocks", "_scales")]
    with atomic_output_dir(out) as tmp:
        weight_map = write_hf_checkpoint(tmp, itertools.chain(buckets, mtp), expected_names=names + mtp_names)
        cfg = exported_config(arch, ckpt, dtype=str(out_dtype).removeprefix("torch."))
        if quantised:
            cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
        if arch.mtp_layers and not mtp_names:
            # a config that promises MTP layers without their tensors loads nowhere that uses them
            log.warning(
                "%s: no multi-token-prediction tensors beside the checkpoint; the export has none and "
                "says num_nextn_predict_layers=0 (pass --mtp-from the original HF directory to carry them)",
                ckpt,
            )
            cfg["num_nextn_predict_layers"] = 0
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        copied = copy_side_files(ckpt, tmp)
        if "generation_config.json" not in copied:
            gen = {
                k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None
            }
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return {"out_dir": str(out), "tensors": len(weight_map), "files": len(set(weight_map.values()))}


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("ckpt_dir")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's dtype")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES)
    p.add_argument(
        "--mtp-from",
        default=None,
        help="HF model directory whose multi-token-prediction layers (num_nextn_predict_layers) the export "
        "carries unchanged; default: those stored beside a converted checkpoint (a learner checkpoint has "
        "none: pass the model its run started from)",
    )
    p.add_argument(
        "--mxfp4",
        action="store_true",
        help="write gpt-oss's expert weights in the MXFP4 layout the release ships (_blocks/_scales): exact "
        "for weights that are MXFP4 numbers (read from MXFP4, untrained), otherwise rounded (OCP MX v1.0)",
    )
    for axis in ("tp", "pp", "ep", "etp"):
        p.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} size of the torchrun mesh")
    for end in ("first", "last"):
        p.add_argument(
            f"--{end}-stage-layers", type=int, default=None,
            help=f"decoder layers on the {end} pipeline stage (uneven stages, as mesh.{end}_stage_layers)",
        )  # fmt: skip
    a = p.parse_args(argv)
    try:
        s = export(
            a.ckpt_dir,
            a.out_dir,
            tp=a.tp,
            pp=a.pp,
            ep=a.ep,
            etp=a.etp,
            first_stage_layers=a.first_stage_layers,
            last_stage_layers=a.last_stage_layers,
            dtype=a.dtype,
            max_shard_bytes=a.max_shard_bytes,
            mtp_from=a.mtp_from,
            mxfp4=a.mxfp4,
        )
    except MegagrpoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if s is not None:
        print(json.dumps(s))
    return 0


if __name__ == "__main__":  # the torchrun entry (`-m megagrpo.convert.megatron_to_hf`)
    sys.exit(main())
