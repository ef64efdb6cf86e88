"""Reading and writing Hugging Face safetensors checkpoints, one tensor at a time.

`HFCheckpoint` opens a model directory (single `model.safetensors` or a sharded index), checks that every
tensor the map needs exists with the shape the config implies *before* anything is converted, and then
reads tensors lazily. `write_hf_checkpoint` writes buckets of `(hf_name, tensor)` as they arrive into
sharded safetensors plus an index, inside a temporary directory that is renamed into place only when
everything succeeded.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megagrpo.bridge.hf_config import arch_from_hf
from megagrpo.bridge.maps import ParamMap, hf_shapes, param_maps
from megagrpo.bridge.mxfp4 import dequantize_mxfp4
from megagrpo.bridge.transforms import check_hf_shapes, to_megatron
from megagrpo.config.model import ModelArch
from megagrpo.errors import MegagrpoError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Buffers some exporters write that carry no learned weights.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
# Files copied next to a converted checkpoint and back into an exported HF directory.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "tiktoken.model",  # Kimi-K2's tiktoken BPE ranks (read by its tokenization_kimi.py)
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)

# Multi-token-prediction tensors carried beside a converted checkpoint (the learner neither builds nor
# trains them): `mtp-00001.safetensors`, ... with their HF names and dtypes unchanged.
MTP_FILES = "mtp-*.safetensors"

_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


def open_safetensors(path: str | Path):
    """`safe_open(path, "pt")`, with a MegagrpoError naming the file and the fix when it cannot be read.

    Every read of a user's safetensors file goes through here (learner load, conversion, the engine's
    checkpoint shapes in weight sync, the probe), so a truncated download says the same thing everywhere.
    """
    try:
        return safe_open(str(path), "pt")
    except SafetensorError as e:  # a truncated or corrupt header: safetensors checks sizes on open
        raise MegagrpoError(
            f"{path}: not a complete safetensors file ({e}); it is truncated or corrupt: re-download the "
            "model, or re-run `megagrpo convert megatron-to-hf` if it was converted from a checkpoint"
        ) from None
    except OSError as e:
        raise MegagrpoError(
            f"{path}: cannot read ({e.strerror or e}); check the path and its permissions"
        ) from None


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (as `safetensors.torch.load_file`), errors as `open_safetensors`."""
    with open_safetensors(path) as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


class HFCheckpoint:
    """A HF model directory opened for lazy, validated tensor reads."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise MegagrpoError(f"{self.dir}: not a directory; pass a Hugging Face model directory")
        self.config = (
            json.loads((self.dir / "config.json").read_text())
            if (self.dir / "config.json").is_file()
            else None
        )
        self.arch: ModelArch = arch_from_hf(self.dir)
        self.maps: list[ParamMap] = param_maps(self.arch)
        self.file_of: dict[str, str] = self._index()
        self._handles: dict[str, object] = {}
        # stacked expert tensors the checkpoint ships as MXFP4 (`name_blocks` + `name_scales`, gpt-oss's
        # release), read dequantised to bf16 (`bridge.mxfp4`, exact)
        self.mxfp4: set[str] = {
            n
            for m in self.maps
            if m.stacked
            for n in m.hf
            if n not in self.file_of and all(n + s in self.file_of for s in ("_blocks", "_scales"))
        }
        self._validate()

    def _index(self) -> dict[str, str]:
        idx = self.dir / INDEX
        if idx.is_file():
            try:
                weight_map = json.loads(idx.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise MegagrpoError(f"{idx}: not a safetensors index (needs a 'weight_map'): {e}") from e
            for fname in sorted(set(weight_map.values())):
                if not (self.dir / fname).is_file():
                    raise MegagrpoError(
                        f"{self.dir / fname}: shard file listed in {INDEX} is missing; re-download the model"
                    )
            return dict(weight_map)
        single = self.dir / SINGLE
        if not single.is_file():
            raise MegagrpoError(
                f"{self.dir}: neither {SINGLE} nor {INDEX} found; only safetensors are supported"
            )
        with open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), SINGLE)

    def _handle(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = open_safetensors(self.dir / fname)
        return self._handles[fname]

    def _raw_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.file_of[name]).get_slice(name).get_shape())

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.mxfp4:  # blocks [E, rows, G, 16] dequantise to [E, 32 G, rows]
            *lead, rows, groups, _ = self._raw_shape(name + "_blocks")
            return (*lead, 32 * groups, rows)
        return self._raw_shape(name)

    def dtype(self, name: str) -> torch.dtype:
        if name in self.mxfp4:
            for part in ("_blocks", "_scales"):
                code = self._handle(self.file_of[name + part]).get_slice(name + part).get_dtype()
                if code != "U8":
                    raise MegagrpoError(f"tensor {name + part!r}: MXFP4 {part[1:]} must be U8, got {code}")
            return torch.bfloat16
        code = self._handle(self.file_of[name]).get_slice(name).get_dtype()
        if code not in _DTYPES:
            raise MegagrpoError(f"tensor {name!r}: dtype {code} is not supported (float tensors only)")
        return _DTYPES[code]

    def _validate(self) -> None:
        wanted = [n for m in self.maps for n in m.hf if n not in self.mxfp4]
        wanted += [n + part for n in sorted(self.mxfp4) for part in ("_blocks", "_scales")]
        missing = [n for n in wanted if n not in self.file_of]
        if missing:
            raise MegagrpoError(
                f"{self.dir}: tensor {missing[0]!r} (and {len(missing) - 1} more) missing from the checkpoint "
                f"but required by config.json (model_type={self.arch.family})"
            )
        extra = sorted(set(self.file_of) - set(wanted))
        extra = [n for n in extra if not n.endswith(_IGNORABLE_SUFFIXES)]
        # multi-token-prediction layers (not trained; the config's num_nextn_predict_layers counts them)
        mtp = set(self.mtp_names())
        extra = [n for n in extra if n not in mtp]
        # tied checkpoints sometimes still store lm_head; it must then equal the embedding (checked on read)
        if self.arch.tie_embeddings and "lm_head.weight" in extra:
            extra.remove("lm_head.weight")
        if extra:
            raise MegagrpoError(
                f"{self.dir}: tensor {extra[0]!r} (and {len(extra) - 1} more) is not part of a "
                f"{self.arch.family} model with this config.json; the checkpoint and config disagree"
            )
        for name, want in hf_shapes(self.arch).items():
            got = self.shape(name)
            if got != want:
                file = self.file_of.get(name) or self.file_of[name + "_blocks"]
                raise MegagrpoError(
                    f"{self.dir / file}: tensor {name!r} has shape {got} but config.json "
                    f"implies {want}; the checkpoint and its config.json disagree"
                )
            self.dtype(name)

    def mtp_names(self) -> list[str]:
        """The multi-token-prediction layers' tensors (`model.layers.{num_layers + i}.*`, i below the
        config's num_nextn_predict_layers), in file order."""
        mtp = tuple(f"model.layers.{self.arch.num_layers + i}." for i in range(self.arch.mtp_layers))
        return [n for n in self.file_of if mtp and n.startswith(mtp)]

    def iter_mtp(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The MTP tensors, unchanged, in buckets of about `bucket_bytes` (the last tensor of a bucket
        may pass it), read as each bucket is taken: to write them beside an export. Host memory: one bucket."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name in self.mtp_names():
            t = self.get(name)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def write_mtp(self, out_dir: Path, shard_bytes: int = 4 << 30) -> list[str]:
        """Copy the MTP tensors, bit for bit, into `MTP_FILES` shards of at most `shard_bytes` (one tensor
        larger than that gets a shard of its own) in `out_dir`; return their names. Host memory: one shard."""
        shard: dict[str, torch.Tensor] = {}
        size, files = 0, 0
        names = self.mtp_names()
        for i, name in enumerate(names):
            t = self.get(name)
            shard[name] = t
            size += t.numel() * t.element_size()
            if size >= shard_bytes or i == len(names) - 1:
                files += 1
                save_file(shard, str(out_dir / f"mtp-{files:05d}.safetensors"), metadata={"format": "pt"})
                shard, size = {}, 0
        return names

    def get(self, name: str) -> torch.Tensor:
        if name in self.mxfp4:
            return dequantize_mxfp4(*(self._raw(name + part) for part in ("_blocks", "_scales")))
        return self._raw(name)

    def _raw(self, name: str) -> torch.Tensor:
        return self._handle(self.file_of[name]).get_tensor(name)

    def tensors(self, pm: ParamMap) -> list[torch.Tensor]:
        """`pm`'s HF sources; of stacked expert tensors only its expert's slice is read."""
        if pm.stacked:
            ts = [self._expert_slice(n, pm.expert) for n in pm.hf]
        else:
            ts = [self.get(n) for n in pm.hf]
        check_hf_shapes(pm, ts)
        return ts

    def _expert_slice(self, name: str, expert: int) -> torch.Tensor:
        """Slice [expert] of a stacked tensor, reading only that expert (of its blocks and scales)."""
        if name in self.mxfp4:
            parts = [
                self._handle(self.file_of[name + p]).get_slice(name + p)[expert]
                for p in ("_blocks", "_scales")
            ]
            return dequantize_mxfp4(*parts)
        return self._handle(self.file_of[name]).get_slice(name)[expert]

    def megatron_tensor(
        self, pm: ParamMap, padded_vocab: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The full megatron tensor for `pm` (reads only its HF sources)."""
        full = to_megatron(pm, self.tensors(pm), self.arch, padded_vocab)
        return full if dtype is None or full.dtype == dtype else full.to(dtype)

    def close(self) -> None:
        self._handles.clear()

    def total_bytes(self) -> int:
        return sum(os.path.getsize(self.dir / f) for f in set(self.file_of.values()))


def mtp_layer_prefixes(model_dir: str) -> tuple[str, ...]:
    """`model.layers.{i}.` of the checkpoint's multi-token-prediction layers (HF `num_nextn_predict_layers`
    of them after the `num_hidden_layers` main ones: DeepSeek-V3/R1, GLM-4.5), () when it has none.

    A weight sync neither sends nor expects them: the learner does not train them (it builds the main model
    only), and SGLang's target model skips every layer past `num_hidden_layers` at load (its NextN draft
    model, used for speculative decoding only, reads them from the checkpoint). The export carries them
    unchanged from the source checkpoint instead (`trainer.weights.save_hf`, `convert`)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    n, extra = int(cfg.get("num_hidden_layers") or 0), int(cfg.get("num_nextn_predict_layers") or 0)
    return tuple(f"model.layers.{n + i}." for i in range(extra))


@contextmanager
def atomic_output_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temp dir beside `out_dir`; on success rename it to `out_dir`, on failure delete it.

    An existing non-empty `out_dir` is refused, so a failed run never destroys previous output.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MegagrpoError(
            f"{out}: output directory exists and is not empty; remove it or choose another path"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial.", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remote_code_files(src: Path) -> list[str]:
    """The Python files in `src` that the `auto_map`s of its config.json and tokenizer_config.json name
    (Kimi-K2: configuration_deepseek.py, tokenization_kimi.py), with the local modules they import
    (transformers' `get_relative_import_files`, as its loader copies them). References into another
    repository (`repo--module.Class`) have no file here."""
    modules: set[str] = set()
    for name in ("config.json", "tokenizer_config.json"):
        path = src / name
        if not path.is_file():
            continue
        try:
            auto_map = json.loads(path.read_text()).get("auto_map") or {}
        except json.JSONDecodeError as e:
            raise MegagrpoError(f"{path}: not valid JSON ({e}); restore the model's {name}") from e
        refs = auto_map if isinstance(auto_map, list) else list(auto_map.values())
        for ref in refs:
            for r in ref if isinstance(ref, list) else [ref]:
                if isinstance(r, str) and "--" not in r and "." in r:
                    modules.add(r.rsplit(".", 1)[0] + ".py")
    files = {m for m in modules if (src / m).is_file()}
    if files:
        from transformers.dynamic_module_utils import get_relative_import_files

        for m in sorted(files):
            files |= {Path(f).name for f in get_relative_import_files(str(src / m))}
    return sorted(files)


def copy_side_files(src: Path, dst: Path, names: Iterable[str] = SIDE_FILES) -> list[str]:
    """Copy tokenizer / generation-config files that exist in `src`, and the Python files its auto_maps
    name (`remote_code_files`), so `dst` loads wherever `src` did; return the names copied."""
    copied = []
    for n in [*names, *remote_code_files(src)]:
        if (src / n).is_file():
            shutil.copy2(src / n, dst / n)
            copied.append(n)
    return copied


def write_hf_checkpoint(
    out_dir: Path,
    buckets: Iterable[list[tuple[str, torch.Tensor]]],
    *,
    expected_names: list[str] | None = None,
    on_bucket: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """Write each bucket as one safetensors shard in `out_dir` (an already-created temp dir) + the index.

    Returns the weight map {hf_name: file}. With `expected_names`, the written key set must equal it.
    """
    files: list[list[str]] = []
    total = 0
    for i, bucket in enumerate(buckets):
        if not bucket:
            continue
        tmp_name = f"part-{i:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in bucket}, str(out_dir / tmp_name), metadata={"format": "pt"})
        files.append([n for n, _ in bucket])
        total += sum(t.numel() * t.element_size() for _, t in bucket)
        if on_bucket is not None:
            on_bucket(sum(t.numel() * t.element_size() for _, t in bucket))
    weight_map: dict[str, str] = {}
    parts = sorted(p.name for p in out_dir.glob("part-*.safetensors"))
    for j, (part, names) in enumerate(zip(parts, files, strict=True)):
        final = SINGLE if len(files) == 1 else f"model-{j + 1:05d}-of-{len(files):05d}.safetensors"
        (out_dir / part).rename(out_dir / final)
        for n in names:
            if n in weight_map:
                raise RuntimeError(f"exporter produced {n!r} twice")
            weight_map[n] = final
    if expected_names is not None and set(weight_map) != set(expected_names):
        missing = sorted(set(expected_names) - set(weight_map))
        extra = sorted(set(weight_map) - set(expected_names))
        raise RuntimeError(f"exported key set differs from the map: missing {missing[:3]}, extra {extra[:3]}")
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def mtp_buckets(src: Path) -> tuple[list[str], Iterator[list[tuple[str, torch.Tensor]]]]:
    """(names, buckets) of the multi-token-prediction tensors carried beside a checkpoint in `src`
    (`MTP_FILES`, written by `HFCheckpoint.write_mtp`); each shard is read when its bucket is taken."""
    files = sorted(src.glob(MTP_FILES))
    names: list[str] = []
    for f in files:
        with open_safetensors(f) as h:
            names += list(h.keys())  # noqa: SIM118 (safe_open is not a mapping)

    def buckets() -> Iterator[list[tuple[str, torch.Tensor]]]:
        for f in files:
            yield list(read_safetensors(f).items())

    return names, buckets()
