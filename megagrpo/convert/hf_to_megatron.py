"""Convert a Hugging Face checkpoint into a megatron-core dist checkpoint (torch_dist) for any mesh.

    megagrpo convert hf-to-megatron HF_DIR OUT_DIR [--dtype bfloat16]
    python tools/convert_hf_to_megatron.py HF_DIR OUT_DIR [--dtype bfloat16]

OUT_DIR receives the dist checkpoint (`metadata.json`, `.metadata`, `__0_0.distcp`), the HF
`config.json`, tokenizer and generation-config files, the multi-token-prediction layers' tensors unchanged
(`mtp-*.safetensors`, when the config has num_nextn_predict_layers: not trained, carried for the export),
and `megagrpo_checkpoint.json` (architecture, padded vocab, dtype) that marks it as ours. Tensors stream one parameter at a time from the safetensors
files: megatron's keys and shapes come from its own `sharded_state_dict()` of the model built on the meta
device, so no weight is allocated up front and peak memory stays near the largest parameter group.
Everything is written in a temporary directory renamed into place at the end; a failure leaves nothing.
The checkpoint's dtype is its weights' own (`--dtype` converts them); the routers' correction bias, which
released checkpoints ship in fp32 beside bf16 weights, stays fp32 either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from megagrpo.bridge.dist_ckpt import chunks_from_sharded_state_dict, write_dist_checkpoint
from megagrpo.bridge.export import BUFFER_SUFFIXES
from megagrpo.bridge.hf_io import HFCheckpoint, atomic_output_dir, copy_side_files
from megagrpo.bridge.maps import param_maps
from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError
from megagrpo.net import free_port

MARKER = "megagrpo_checkpoint.json"
FORMAT = "megagrpo-megatron-torch_dist"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_single_process() -> None:
    """Megatron parallel state with TP=EP=PP=1 (a fresh one-process group unless one already exists).

    A caller that already runs such a mesh (e.g. every rank of a data-parallel job) keeps it, so the
    meta model can be built on any one rank without collectives.
    """
    import torch.distributed as dist

    from megagrpo.compat import apply_cpu_compat
    from megagrpo.learner.mesh import DistEnv, MeshConfig, init_mesh

    apply_cpu_compat()
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized() and (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    ) == (1, 1, 1):
        return
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise MegagrpoError("conversion needs a TP=PP=EP=1 mesh; run it in its own process")
    env = None if dist.is_initialized() else DistEnv(0, 1, 0, "127.0.0.1", free_port("127.0.0.1"), "single")
    init_mesh(MeshConfig(), env)


# megatron's TransformerConfig rejects its default "allgather" dispatcher with variable_seq_lengths even
# for dense models; the choice has no effect on a dense model's parameters.
CONFIG_OVERRIDES = {"moe_token_dispatcher_type": "alltoall"}


def build_model(arch: ModelArch, mesh_cfg=None, dtype: torch.dtype = torch.float32, *, meta: bool = False):
    """This rank's GPTModel chunks via the learner's builder (local spec); on the meta device if `meta`."""
    import contextlib

    from megagrpo.learner.mesh import MeshConfig
    from megagrpo.learner.model import build_gpt_model

    overrides = dict(CONFIG_OVERRIDES)
    if meta:
        overrides["perform_initialization"] = False
    with torch.device("meta") if meta else contextlib.nullcontext():
        return build_gpt_model(
            arch, mesh_cfg or MeshConfig(), dtype=dtype, layer_spec="local", config_overrides=overrides
        )


def meta_model(arch: ModelArch, dtype: torch.dtype):
    """The single-process GPTModel built on the meta device (names, shapes and sharding, no storage)."""
    (model,) = build_model(arch, dtype=dtype, meta=True)
    return model


def read_checkpoint_info(ckpt_dir: str | Path) -> dict:
    """{"arch": ModelArch dict, "dtype": name} of a checkpoint written by this tool or by the learner.

    Raises MegagrpoError naming the directory when it is neither (the learner's `read_meta` explains
    foreign, incomplete and interrupted directories).
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise MegagrpoError(
            f"{ckpt_dir}: not a directory; pass a checkpoint written by convert_hf_to_megatron"
        )
    marker = ckpt_dir / MARKER
    if marker.is_file():
        try:
            meta = json.loads(marker.read_text())
        except json.JSONDecodeError as e:
            raise MegagrpoError(f"{marker}: not valid JSON ({e})") from e
        if meta.get("format") != FORMAT:
            raise MegagrpoError(f"{marker}: format={meta.get('format')!r}, expected {FORMAT!r}")
        for f in ("metadata.json", ".metadata"):
            if not (ckpt_dir / f).is_file():
                raise MegagrpoError(f"{ckpt_dir / f}: missing; the dist checkpoint is incomplete")
        return {"arch": meta["arch"], "dtype": meta["dtype"]}
    if not (ckpt_dir / "meta.json").is_file():
        raise MegagrpoError(
            f"{ckpt_dir}: neither {MARKER} nor meta.json is present, so this is not a megagrpo checkpoint; "
            "convert HF weights with tools/convert_hf_to_megatron.py or pass a learner step_* directory"
        )
    from megagrpo.learner.checkpoint import read_meta

    meta = read_meta(ckpt_dir)
    if meta.arch is None:
        raise MegagrpoError(f"{ckpt_dir / 'meta.json'}: no model architecture recorded; cannot export it")
    return {"arch": meta.arch, "dtype": _stored_dtype(ckpt_dir)}


def _stored_dtype(ckpt_dir: Path) -> str:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    entry = md.get("embedding.word_embeddings.weight")
    if entry is None:
        raise MegagrpoError(
            f"{ckpt_dir}: the checkpoint holds no model weights (embedding.word_embeddings.weight)"
        )
    return str(entry.properties.dtype).removeprefix("torch.")


def write_learner_meta(ckpt_dir: Path, arch: ModelArch, source: str) -> None:
    """The learner's `meta.json` (weights only, step 0), so `learner.checkpoint.load_checkpoint` reads it."""
    import dataclasses as dc

    from megagrpo.learner.checkpoint import CheckpointMeta

    files = {
        str(p.relative_to(ckpt_dir)): p.stat().st_size
        for p in sorted(ckpt_dir.rglob("*"))
        if p.is_file() and p.name != "meta.json"
    }
    meta = CheckpointMeta(
        step=0,
        consumed_samples=0,
        arch=json.loads(json.dumps(arch.to_dict())),
        mesh={"tp": 1, "pp": 1, "ep": 1, "etp": 1, "cp": 1, "dp": 1, "vpp": 1, "world_size": 1},
        has_optimizer=False,
        has_scheduler=False,
        megagrpo_version=__import__("megagrpo").__version__,
        created_unix=time.time(),
        extra={"converted_from": source},
        files=files,
    )
    (ckpt_dir / "meta.json").write_text(json.dumps(dc.asdict(meta), indent=2) + "\n")


def convert(
    hf_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None, progress: bool = True
) -> dict:
    """Convert; return a summary (bytes, seconds, peak chunk)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from megagrpo.learner.model import padded_vocab_size

    t0 = time.perf_counter()
    ckpt = HFCheckpoint(hf_dir)  # validates files, keys and shapes before anything is written
    arch = ckpt.arch
    # Released checkpoints (DeepSeek-V3, Kimi-K2, GLM-4.5) ship the router's correction bias in fp32 beside
    # a bf16 body. megatron holds it as an fp32 buffer whatever the parameters' dtype, so it neither decides
    # the checkpoint's dtype nor is cast to it (issue 43: rounded to bf16, 8 distinct biases became 3 and
    # 3% of the top-2 choices changed).
    body: dict[torch.dtype, str] = {}
    for m in ckpt.maps:
        if not m.mcore.endswith(BUFFER_SUFFIXES):
            for n in m.hf:
                body.setdefault(ckpt.dtype(n), n)
    if dtype is None:
        if len(body) != 1:
            seen = ", ".join(f"{str(d).removeprefix('torch.')} ({n})" for d, n in body.items())
            raise MegagrpoError(
                f"{hf_dir}: the weights have mixed dtypes: {seen}; pass --dtype with the one to convert to"
            )
        (tdtype,) = body
    else:
        if dtype not in DTYPES:
            raise MegagrpoError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        tdtype = DTYPES[dtype]
    padded = padded_vocab_size(arch, 1)
    init_single_process()
    model = meta_model(arch, tdtype)
    chunks, objects = chunks_from_sharded_state_dict(model.sharded_state_dict())
    by_name = {m.mcore: m for m in param_maps(arch)}
    unknown = sorted({c.source for c in chunks} - set(by_name))
    if unknown:
        raise MegagrpoError(
            f"megatron parameter {unknown[0]!r} has no entry in the {arch.family} parameter map"
        )
    del model

    def produce(name: str) -> torch.Tensor:
        # in the source's dtype: the writer casts it once to the dtype the model holds it in (the chunk's:
        # tdtype for the parameters, fp32 for the bias buffer), so nothing is rounded through tdtype first
        return ckpt.megatron_tensor(by_name[name], padded)

    total = sum(c.nbytes for c in chunks)
    with atomic_output_dir(out_dir) as tmp:
        with Progress(
            TextColumn("[bold]hf->megatron"),
            BarColumn(),
            DownloadColumn(),
            TimeRemainingColumn(),
            disable=not progress,
            transient=True,
        ) as bar:
            task = bar.add_task("convert", total=total)
            write_dist_checkpoint(
                tmp, chunks, objects, produce, on_chunk=lambda c: bar.advance(task, c.nbytes)
            )
        (tmp / "config.json").write_text(json.dumps(ckpt.config, indent=2) + "\n")
        copy_side_files(Path(hf_dir), tmp)
        # not trained, but carried: the export writes them back so the model loads where the source did
        mtp = ckpt.write_mtp(tmp)
        summary = {
            "format": FORMAT,
            "version": 1,
            "arch": arch.to_dict(),
            "padded_vocab_size": padded,
            "dtype": str(tdtype).removeprefix("torch."),
            "source": str(Path(hf_dir).resolve()),
            "bytes": total,
            "mtp_tensors": len(mtp),
        }
        (tmp / MARKER).write_text(json.dumps(summary, indent=2) + "\n")
        write_learner_meta(tmp, arch, summary["source"])  # last: it records every other file's size
    ckpt.close()
    summary["seconds"] = time.perf_counter() - t0
    return summary


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the checkpoint's dtype")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:
        s = convert(a.hf_dir, a.out_dir, dtype=a.dtype, progress=not a.no_progress)
    except MegagrpoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out_dir": a.out_dir, "bytes": s["bytes"], "seconds": round(s["seconds"], 3)}))
    return 0
